"""pixdit's Hydra configs, installed as the package ``pixdit.configs`` (the entry points load ``pkg://pixdit.configs``).

Only the YAML files matter; this file makes the folder a package that Hydra and ``importlib.resources`` can find.
"""
