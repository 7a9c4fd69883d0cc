"""Typed, validated configuration; YAML files beside this module map onto `HarvestConfig`."""

from conf.schema import ConfigError, HarvestConfig, load_config

__all__ = ["ConfigError", "HarvestConfig", "load_config"]
