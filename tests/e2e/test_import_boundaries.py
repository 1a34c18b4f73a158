"""What a package imports, seen from a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys


def test_data_pipeline_imports_only_the_batch_format():
    """data_pipeline takes plain arguments: of megatransformer it imports the batch format, nothing else."""
    code = (
        "import sys, data_pipeline.loader, data_pipeline.shard, data_pipeline.objectives, data_pipeline.inspect, "
        "data_pipeline.remote; print(sorted(m for m in sys.modules if m.startswith('megatransformer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['megatransformer', 'megatransformer.batch']"
