"""``python train.py ...`` runs ``pixdit-train ...`` (pixdit.cli.train; its docstring lists the commands)."""

from pixdit.cli.train import main, train  # noqa: F401  (`train`: the function, for code that did `import train`)

if __name__ == "__main__":
    main()
