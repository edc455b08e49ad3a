"""Other tools' configuration files: read (imports) and written (exports)."""
