"""Core's own plugin (entry point ``core``), registered like any third-party plugin."""
