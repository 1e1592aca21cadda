"""The config of ``pixdit-evaluate`` (``pkg://pixdit.configs.eval``); a package so Hydra can load it when installed."""
