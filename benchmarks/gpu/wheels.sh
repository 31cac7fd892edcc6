#!/bin/bash
# Run in the project's root, with .venv made (make run or make test): `bash benchmarks/gpu/wheels.sh`
# downloads, into .whl/ (git-ignored), the Python 3.12 x86-64 wheels that run.sh installs on the GPU
# machine: the project's runtime dependencies (pyproject.toml's, and theirs as installed in .venv) that
# the machine's image lacks (its list: the device entry's KINDS.md in the tool library), and always the
# `gpu` extra (nvidia-ml-py: NVML utilisation sampling), so that does not hang on the image's copy.
set -euo pipefail
LIST=${KINDS_MD:-/work/.library/device/KINDS.md}
missing=$(.venv/bin/python - "$LIST" <<'PY'
import re, sys, tomllib, importlib.metadata as md
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
text = open(sys.argv[1]).read()
have = {norm(x) for x in re.search(r"Packages: (.*?)\.\s*$", text, re.M | re.S).group(1).split(", ")}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
always = {norm(r.name) for r in extra}
need, todo = {}, [Requirement(r) for r in project["dependencies"]] + extra
while todo:
    r = todo.pop()
    if norm(r.name) in need or (r.marker and not r.marker.evaluate(env)): continue
    try: d = md.distribution(r.name)
    except md.PackageNotFoundError:  # not in .venv: the newest wheel the requirement allows
        need[norm(r.name)] = f"{r.name}{r.specifier}"; continue
    need[norm(r.name)] = f"{norm(r.name)}=={d.version}"
    todo += [Requirement(x) for x in d.requires or []]
skip = (have - always) | {"autoresearch", "huggingface-hub", "kernels"}  # peft is there with its own hub
print(" ".join(spec for name, spec in sorted(need.items()) if name not in skip))
PY
)
mkdir -p .whl
plats=""; for n in 17 24 27 28 31 34; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
for p in $missing; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plats --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$p"
done
echo "$missing" | tr ' ' '\n' | grep -i nvidia-ml-py
ls .whl | wc -l; du -sh .whl
