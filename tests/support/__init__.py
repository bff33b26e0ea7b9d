"""Helpers and fixtures the test folders share (tests/ is on sys.path: `from support.tiny import ...`)."""
