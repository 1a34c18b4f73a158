"""A collective that failed for want of another rank becomes one line naming the collective and where it was
called from; any other error stays itself. The tracebacks are made by functions compiled under the file names
of torch's and DeepSpeed's modules, so the frames read as the real ones do."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from megatransformer.training.runtime.distributed import collective_failure

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:30860. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv"


def frames_through(*files: tuple[str, str], message: str) -> Callable[[], None]:
    """A function whose call raises RuntimeError(message) from inside functions named and placed as ``files``
    ((path, function name), outermost first)."""
    namespace: dict = {"message": message}
    callee = "raise RuntimeError(message)"
    for path, name in reversed(files):
        source = f"def {name}():\n    {callee}\n"
        exec(compile(source, os.sep + path.replace("/", os.sep), "exec"), namespace)
        callee = f"{name}()"
    return namespace[files[0][1]]


def failure_of(call: Callable[[], None]) -> str | None:
    with pytest.raises(RuntimeError) as caught:
        call()
    return collective_failure(caught.value, 0.5)


def test_zero3s_own_wait_on_a_layers_gather_is_named_when_the_peer_is_gone():
    """ZeRO-3 waits on a gather's handle in partition_parameters.py itself, not through torch.distributed."""
    call = frames_through(
        ("site/megatransformer/harness.py", "_packed_hidden"),
        ("site/torch/nn/modules/module.py", "_call_impl"),
        ("site/deepspeed/runtime/zero/parameter_offload.py", "_pre_forward_module_hook"),
        ("site/deepspeed/runtime/zero/partition_parameters.py", "wait"),
        message=GLOO_PEER_GONE,
    )
    line = failure_of(call)
    assert line is not None
    assert line.startswith("ZeRO-3's gather of a layer's parameters in _packed_hidden (harness.py:")
    assert line.endswith("failed: another rank is gone (Connection closed by peer [127.0.0.1]:30860)")


def test_a_timed_out_gather_names_the_timeout_setting():
    call = frames_through(
        ("site/megatransformer/training/engine/train_module.py", "forward_backward"),
        ("site/deepspeed/runtime/zero/partition_parameters.py", "wait"),
        message=GLOO_TIMEOUT,
    )
    line = failure_of(call)
    assert line is not None and "timed out: no answer from another rank within parallel.timeout_minutes=0.5" in line


def test_a_collective_of_torch_distributed_is_named_by_its_function():
    call = frames_through(
        ("site/megatransformer/training/loop.py", "advance"),
        ("site/torch/distributed/distributed_c10d.py", "all_reduce"),
        message=GLOO_PEER_GONE,
    )
    assert failure_of(call).startswith("all_reduce in advance (loop.py:")


@pytest.mark.parametrize(
    "path, message",
    [
        ("site/deepspeed/runtime/zero/partition_parameters.py", "CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("site/megatransformer/harness.py", GLOO_PEER_GONE),  # (no collective in the traceback)
    ],
)
def test_other_errors_are_left_as_they_are(path, message):
    assert failure_of(frames_through((path, "work"), message=message)) is None
