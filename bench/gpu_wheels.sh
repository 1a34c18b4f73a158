#!/usr/bin/env bash
# The wheels the GPU suite needs on an offline GPU machine (Python 3.12, manylinux x86-64, its CUDA build of
# PyTorch already installed): downloaded on a machine with network, packed into one tar with its SHA-256, then
# checked and installed there. Two sets (docs/gpu.md):
#   core  what the image lacks for the suite: one tar of ~11 MB, carried by the device call that installs it and
#         runs the suite. For an image whose torch is older than 2.13, where the project refuses flash-attn 4 and 3
#         anyway (gpu_cores.REGISTRY_TORCH): the H200 image's torch 2.11.
#   fa4   core and flash-attn 4 with its CUTLASS DSL (~120 MB): the tar split in two parts of equal size (each fits
#         one device call's 64 MiB), carried by two calls on the warm machine. For an image with torch >= 2.13.
#
#   bench/gpu_wheels.sh download core|fa4 [DIR]       # DIR (default build/gpu-wheels/MODE): wheels/, wheels.tar
#                                                      #   (fa4: wheels.tar.part-aa/-ab), SHA256SUMS
#   bench/gpu_wheels.sh install core|fa4 TAR... SUMS   # on the GPU machine: the tar (fa4: its parts in order),
#                                                      #   then SHA256SUMS
set -euo pipefail

# What the image lacks for the suite, DeepSpeed aside: webdataset, pydantic and their dependencies (typing-extensions:
# the image's may be older than pydantic's >= 4.14.1), DeepSpeed's other requirements (the image is reported to
# have them, but pip's offline install stops on any one missing), and zstandard (data_pipeline's .zst files).
# bench/gpu_suite.py --dry checks this list against every import of the suite's phases and every requirement of
# what it installs. Pinned: resolved and downloaded for Python 3.12 on manylinux x86-64 (2026-11-28; zstandard
# 2026-12-02).
CORE=(
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
  einops==0.8.2
  zstandard==0.25.0
)
# flash-attn 4 and what it imports (nvidia-cutlass-dsl's CUDA 12 libraries, as a plain `pip install --pre
# flash-attn-4` installs them; they run on CUDA 13 drivers too): fa4 mode only.
FA4=(
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
)
DEEPSPEED=deepspeed==0.19.8  # a source distribution only on PyPI: built into a wheel here
INSTALL_CORE=(deepspeed==0.19.8 webdataset==1.0.2 pydantic==2.13.4 zstandard==0.25.0)
INSTALL_FA4=(flash-attn-4==4.0.0b36)
IMPORTS_CORE="deepspeed, webdataset, pydantic, zstandard"
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

download() {
  local mode=$1 dir=${2:-build/gpu-wheels/$1} wheels=("${CORE[@]}")
  if [ "$mode" = fa4 ]; then
    wheels+=("${FA4[@]}")
  fi
  rm -rf "$dir/wheels" "$dir"/wheels.tar "$dir"/wheels.tar.part-*  # (one version of each: two stop the install)
  mkdir -p "$dir/wheels"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "${PLATFORMS[@]/#/--platform=}" \
    -d "$dir/wheels" "${wheels[@]}"
  python3 -m pip wheel --no-deps --no-build-isolation -w "$dir/wheels" "$DEEPSPEED"
  tar -C "$dir" -cf "$dir/wheels.tar" wheels
  (cd "$dir" && sha256sum wheels.tar > SHA256SUMS)
  if [ "$mode" = fa4 ]; then
    split -n 2 "$dir/wheels.tar" "$dir/wheels.tar.part-"
    rm "$dir/wheels.tar"
  fi
  ls -l "$dir"/wheels.tar* "$dir/SHA256SUMS"
}

install() {
  local mode=$1 sums=${*: -1} parts=("${@:2:$#-2}") dir names=("${INSTALL_CORE[@]}") imports=$IMPORTS_CORE
  if [ "$mode" = fa4 ]; then
    names+=("${INSTALL_FA4[@]}")
    imports+=", flash_attn.cute.interface"
  fi
  sums=$(realpath "$sums")
  dir=$(mktemp -d)
  cat "${parts[@]}" > "$dir/wheels.tar"
  (cd "$dir" && sha256sum --check "$sums")
  tar -C "$dir" -xf "$dir/wheels.tar"
  # what the image already has (torch, numpy, ...) is kept; pip takes only what is missing from the wheels
  python3 -m pip install -q --no-index --no-compile --disable-pip-version-check --find-links "$dir/wheels" \
    "${names[@]}"
  python3 -c "import torch, $imports; print('installed ($mode): torch', torch.__version__)"
}

usage() {
  echo "usage: $0 download core|fa4 [DIR] | install core|fa4 TAR... SHA256SUMS" >&2
  exit 2
}

case ${1:-}:${2:-} in
  download:core | download:fa4) shift; download "$@" ;;
  install:core | install:fa4) [ $# -ge 4 ] || usage; shift; install "$@" ;;
  *) usage ;;
esac
