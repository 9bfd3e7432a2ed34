"""Built-in tiny model and toy task: real architectures, created locally, no download."""
