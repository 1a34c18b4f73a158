"""One rank of a ZeRO-3 build under ``torchrun`` (``python -m support.sharded_build OUT``): the bytes its parameters
and torch's host allocator hold at their peak, the model's sizes, and the parameters whose gathered values are not
the one-rank build's, before and after weights are loaded into it (init_from); written to OUT/rank_<r>.json."""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import torch

from megatransformer.config import precision_dtype
from megatransformer.model import build_model
from megatransformer.training.engine import construction
from megatransformer.training.engine.construction import build_for_run, load_into_partitioned
from megatransformer.training.engine.train_module import deepspeed_config
from megatransformer.training.runtime.distributed import setup
from megatransformer.training.runtime.layout import BatchSizes
from support.memory import peak_host_bytes
from support.models import run_config

# sixteen thin layers: a layer is a small part of the model, so a whole model's bytes on a rank stand out; the
# paper's position table, a buffer made in the build
MODEL = dict(
    d_model=128, n_layers=16, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256, max_seq_len=32, position="sinusoidal"
)


class ParameterBytes:
    """The most bytes the parameters made in it hold at once (whole tensors, ZeRO-3 partitions; none on the meta
    device), sampled as each is registered and as each is written (``construction.draw_own_partition``,
    ``construction.load_own_partition``); and how many times a parameter was gathered (``gathers``)."""

    def __init__(self) -> None:
        self.params: list[weakref.ref] = []
        self.most = 0

    def sample(self) -> None:
        held = 0
        for ref in self.params:
            p = ref()
            if p is not None and not p.is_meta:
                held += p.data.nbytes + (p.ds_tensor.nbytes if hasattr(p, "ds_tensor") else 0)
        self.most = max(self.most, held)

    def __enter__(self) -> ParameterBytes:
        def registered(module, name, param):
            if param is not None:
                self.params.append(weakref.ref(param))
            self.sample()

        def sampled(original):
            def written(*args):
                original(*args)
                self.sample()

            return written

        def counted_gathers(*args, **kwargs):
            self.gathers += 1
            return gathered(*args, **kwargs)

        def counted_broadcasts(*args, **kwargs):
            self.broadcasts += 1
            return broadcast(*args, **kwargs)

        import deepspeed
        from deepspeed import comm

        self.gathers, gathered = 0, deepspeed.zero.GatheredParameters
        self.broadcasts, broadcast = 0, comm.broadcast
        fills = {name: getattr(construction, name) for name in ("draw_own_partition", "load_own_partition")}
        self.handle = torch.nn.modules.module.register_module_parameter_registration_hook(registered)
        for name, original in fills.items():
            setattr(construction, name, sampled(original))
        deepspeed.zero.GatheredParameters, comm.broadcast = counted_gathers, counted_broadcasts

        def restore():
            for name, original in fills.items():
                setattr(construction, name, original)
            deepspeed.zero.GatheredParameters, comm.broadcast = gathered, broadcast

        self.restore = restore
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        self.restore()
        self.sample()


def main(out: Path) -> None:
    info = setup()
    record: dict = {"world": info.world_size}
    for precision in ("fp32", "bf16"):  # (the bf16 build is the one counted)
        cfg = run_config(model=MODEL, precision=precision, seed=11, parallel={"zero_stage": 3})
        ds = deepspeed_config(cfg, BatchSizes(1, 1, info.world_size), "cpu", zero_stage=3)
        build_for_run(cfg, 3, ds)  # (once before counting: DeepSpeed's first-use allocations)
        counter = ParameterBytes()
        with counter:
            model = build_for_run(cfg, 3, ds)
        record[f"gathers_in_build_{precision}"] = counter.gathers
        record[f"broadcasts_in_build_{precision}"] = counter.broadcasts
        dtype = precision_dtype(cfg.precision)
        reference = build_model(cfg.model, cfg.seed)
        record[f"differing_{precision}"] = _differing(model, reference, dtype)
        # weights a run starts from (init_from), each written by one rank into the partitioned model
        values: dict[int, float] = {}  # (a tied tensor has one value under each of its names)
        state = reference.state_dict(keep_vars=True)
        weights = {n: torch.full_like(t, values.setdefault(id(t), 0.25 * len(values))) for n, t in state.items()}
        with counter:
            load_into_partitioned(model, weights)
        record[f"gathers_in_load_{precision}"] = counter.gathers
        record[f"broadcasts_in_load_{precision}"] = counter.broadcasts
        reference.load_state_dict(weights)
        record[f"differing_loaded_{precision}"] = _differing(model, reference, dtype)
    params = dict(model.named_parameters())
    # the largest module a rank may hold whole at once: an embedding table, a block, the output head
    parts = [*reference.decoder.layers, reference.embed_tokens, reference.lm_head]
    record["layer"] = max(sum(p.numel() for p in part.parameters()) for part in parts) * dtype.itemsize
    record["whole"] = sum(p.numel() for p in reference.parameters())
    record["partition"] = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params.values())
    record["held"] = counter.most
    record["peak"] = peak_host_bytes(lambda: build_for_run(cfg, 3, ds), python=False)
    record["whole_build"] = peak_host_bytes(lambda: build_model(cfg.model, cfg.seed), python=False)  # (fp32, whole)
    (out / f"rank_{info.rank}.json").write_text(json.dumps(record))


def _differing(model: torch.nn.Module, reference: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """The names of ZeRO-3 ``model``'s parameters whose gathered values are not ``reference``'s in ``dtype``, and of
    its buffers that are not ``reference``'s (DeepSpeed leaves buffers as the model makes them)."""
    import deepspeed

    params = dict(model.named_parameters())
    buffers = [name for name, buffer in model.named_buffers() if not torch.equal(buffer, reference.get_buffer(name))]
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return buffers + [
            name
            for name, param in params.items()
            if not torch.equal(param.data, reference.get_parameter(name).detach().to(dtype))
        ]


if __name__ == "__main__":
    main(Path(sys.argv[1]))
