"""Version-pinned patches for third-party engines."""
