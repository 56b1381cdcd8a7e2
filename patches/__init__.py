"""The carried changes, one folder each. See each folder's ``patch.toml``."""
