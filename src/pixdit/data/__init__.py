"""Datasets as webdataset shards: writing them (shards, prepare, quickstart) and streaming them (datamodule).

See docs/data.md. Entry points: scripts/prepare_data.py, scripts/make_quickstart_data.py, scripts/bench_data.py,
and `ShardDataModule` (configs/data/*.yaml).
"""
