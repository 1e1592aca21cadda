"""``trainer=fsdp``: one run sharded over several GPUs with FSDP2 (``torch.distributed.fsdp.fully_shard``), through
Lightning's ModelParallelStrategy.

    python train.py experiment=ffhq256_llsa model=dit_xl trainer=fsdp trainer.devices=2

Registered with Lightning as the strategy name ``fsdp2`` (configs/trainer/fsdp.yaml), built when a run's config
names it. What it does, and why this way:

* Sharding: each DiT block is one FSDP unit (its weights are all-gathered just before it runs and freed again after
  its forward and its backward), the rest of the model (embedders, final layer) the root unit. Weights, gradients
  and AdamW's moments are split over the GPUs: 16 bytes per parameter become 16 / world_size.
* FSDP2 rather than Lightning's FSDPStrategy (FSDP1): FSDP1 wraps the whole LightningModule, so the EMA copy would
  be flattened into the model's sharded parameters; FSDP2 shards each parameter as a DTensor in place, so names and
  shapes stay those of the unsharded model (optimizer, clipping, state dicts, grad checkpointing see the same
  model). FSDP1 is also deprecated in PyTorch, and FSDP2 runs on CPU processes with gloo, where the tests check it.
* EMA: not sharded. Every GPU keeps the full fp32 EMA copy, updated from the gathered weights after each step
  (``pixdit.ema``), so rank 0's sample grids, the EMA validation loss and the EMA artifact work as without FSDP.
  Costs 4 bytes per parameter per GPU (2.7 GB for DiT-XL) and one all-gather of the weights per step.
* Precision: the Trainer's, exactly as with DDP: ``bf16-mixed`` is autocast over fp32 weights; FSDP gathers weights
  and reduces gradients in fp32 (MixedPrecisionPolicy's defaults). Gathering bf16 weights would halve the traffic
  but change the numerics of the ops autocast leaves in fp32; not done.
* Checkpoints: full state dicts (``save_distributed_checkpoint=False``): rank 0 writes the same single-file .ckpt as
  DDP (with its EMA artifact), readable by pixdit-evaluate and resumable on any number of GPUs; resuming loads it
  into the shards. A resumed run continues exactly (tests/test_distributed.py).
* Data parallel over all GPUs of all nodes (``data_parallel_size`` = world size, no tensor parallelism).
"""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

STRATEGY_NAME = "fsdp2"


class FSDPStrategy(ModelParallelStrategy):
    """ModelParallelStrategy as plain FSDP2 data parallelism: every process is one data-parallel shard, checkpoints
    are full state dicts. The model is sharded by ``DiffusionModule.configure_model`` (``shard_model``)."""

    def __init__(self, **options):
        super().__init__(save_distributed_checkpoint=False, **options)

    def setup_environment(self) -> None:
        # Known only now: the number of processes of the run (devices x nodes), all of them data-parallel.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()


def shard_model(model: nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: each DiT block one unit, the rest of the model the root unit (in place; idempotent)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        return  # Lightning calls configure_model again for a later fit / validate
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


if STRATEGY_NAME not in StrategyRegistry:
    StrategyRegistry.register(STRATEGY_NAME, FSDPStrategy, description="pixdit: FSDP2, one unit per DiT block")
