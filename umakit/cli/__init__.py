"""umakit's command line: a thin click layer over the `umakit` library."""
