#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels the GPU machine lacks into .whl/ at the
# repository root (ignored by git; carried to the device with the run). The device has Python
# 3.12 on manylinux x86_64, torch with CUDA 13, but no fastapi/uvicorn/pydantic/ucxx.
# Usage: bash bench/gpu/fetch_wheels.sh   (then carry ".whl"; bench/gpu/run_all.sh installs it)
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
PLATFORMS=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done
# Versions pinned like constraints.txt (the serving stack, llguidance for structured outputs) and the ucxx 0.52 line (CUDA 13
# builds; libucxx 0.52 needs libucx < 1.22).
PKGS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4
  annotated-types==0.7.0 typing-inspection==0.4.2 annotated-doc==0.0.7 uvicorn==0.54.0
  llguidance==1.9.1
  ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 'libucx-cu13>=1.21,<1.22' 'librmm-cu13==26.10.*' 'rapids-logger==0.3.*' opentelemetry-api 'rmm-cu13==26.10.*'

)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d .whl "${PKGS[@]}"
du -sh .whl
ls .whl
