"""Engine replicas and the Ray actor that owns them."""
