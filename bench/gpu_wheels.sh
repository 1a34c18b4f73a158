#!/usr/bin/env bash
# The wheels the GPU suite needs on an offline GPU machine (Python 3.12, manylinux x86-64, its CUDA build of
# PyTorch already installed): downloaded on a machine with network, packed into one tar split in two parts of
# equal size (each fits one device call's 64 MiB), then joined, checked and installed there. docs/gpu.md.
#
#   bench/gpu_wheels.sh download [DIR]        # DIR (default build/gpu-wheels): wheels/, wheels.tar.part-aa/-ab, SHA256SUMS
#   bench/gpu_wheels.sh install PART... SUMS   # on the GPU machine: the parts in order, then SHA256SUMS
set -euo pipefail

# flash-attn 4 and what it imports (nvidia-cutlass-dsl's CUDA 12 libraries, as a plain `pip install --pre flash-attn-4`
# installs them; they run on CUDA 13 drivers too), DeepSpeed's, webdataset's and pydantic's dependencies the
# image may lack, and zstandard (data_pipeline's .zst shards and inputs; not in the H200 image). Pinned: what was
# resolved and downloaded for Python 3.12 on manylinux x86-64 (2026-11-28; zstandard's cp312 wheel, 5.5 MB,
# 2026-12-02: the two parts grow to ~61 MB each, still under a call's 64 MiB).
WHEELS=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu12==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
  cuda-bindings==13.5.0
  cuda-pathfinder==1.9.1
  protobuf==7.36.2
  einops==0.8.2
  webdataset==1.0.2
  braceexpand==0.1.7
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  hjson==3.1.0
  ninja==1.13.2
  py-cpuinfo==9.0.0
  msgpack==1.2.4
  psutil==7.2.2
  tqdm==4.67.3
  packaging==26.0
  pyyaml==6.0.3
  zstandard==0.25.0
)
DEEPSPEED=deepspeed==0.19.8  # a source distribution only on PyPI: built into a wheel here
INSTALL=(flash-attn-4==4.0.0b36 deepspeed==0.19.8 webdataset==1.0.2 pydantic==2.13.4 zstandard==0.25.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

download() {
  local dir=${1:-build/gpu-wheels}
  mkdir -p "$dir/wheels"
  pip download --no-deps --only-binary=:all: --python-version 3.12 "${PLATFORMS[@]/#/--platform=}" \
    -d "$dir/wheels" "${WHEELS[@]}"
  pip wheel --no-deps --no-build-isolation -w "$dir/wheels" "$DEEPSPEED"
  tar -C "$dir" -cf "$dir/wheels.tar" wheels
  (cd "$dir" && sha256sum wheels.tar > SHA256SUMS)
  rm -f "$dir"/wheels.tar.part-*
  split -n 2 "$dir/wheels.tar" "$dir/wheels.tar.part-"
  rm "$dir/wheels.tar"
  ls -l "$dir"/wheels.tar.part-* "$dir/SHA256SUMS"
}

install() {
  local sums=${*: -1} parts=("${@:1:$#-1}") dir
  dir=$(mktemp -d)
  cat "${parts[@]}" > "$dir/wheels.tar"
  (cd "$dir" && sha256sum --check "$(realpath "$sums")")
  tar -C "$dir" -xf "$dir/wheels.tar"
  pip install --no-index --find-links "$dir/wheels" "${INSTALL[@]}"
  python -c "import flash_attn.cute.interface, deepspeed, webdataset, pydantic, zstandard; print('installed')"
}

case ${1:-} in
  download) shift; download "$@" ;;
  install) shift; [ $# -ge 2 ] || { echo "usage: $0 install PART... SHA256SUMS" >&2; exit 2; }; install "$@" ;;
  *) echo "usage: $0 download [DIR] | install PART... SHA256SUMS" >&2; exit 2 ;;
esac
