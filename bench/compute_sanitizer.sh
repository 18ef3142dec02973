#!/usr/bin/env bash
# Runs the GPU test suite under NVIDIA compute-sanitizer's memcheck (out-of-bounds and misaligned
# device accesses, accesses to freed or unmapped memory, device-side hardware exceptions, CUDA API
# errors) and prints one summary line over every process the suite started.
#
#   bash bench/compute_sanitizer.sh                    # python -m pytest -m gpu tests/gpu -x -q
#   bash bench/compute_sanitizer.sh -m gpu tests/gpu/test_torch_bridge_gpu.py -q   # other pytest args
#
# Environment:
#   COMPUTE_SANITIZER        path of the compute-sanitizer binary (default: PATH, then CUDA installs)
#   COMPUTE_SANITIZER_FLAGS  extra flags, e.g. "--leak-check full" (gpumem keeps its pool until exit,
#                            so leak reports at exit list cached memory; off by default)
#   LOG_DIR                  where the per-process logs go (default: $OUT/compute-sanitizer if $OUT is
#                            set, else build/compute-sanitizer)
# Exit status: 0 only when pytest passed and memcheck reported 0 errors in every process.
#
# Flags, and why:
#   --target-processes all   pytest, torch's compile workers and torchrun children are all checked
#   --require-cuda-init no   child processes that never touch CUDA are not errors
#   --launch-timeout 600     Python + torch start slowly under the tool
#   --log-file ...%p         one log per process (pytest's own output stays on the console)
#   --report-api-errors explicit (the default): CUDA calls that return errors the caller did not
#                            expect are counted; probes torch makes on purpose are reported too, and
#                            the summary lists them apart from memory errors so they can be judged
set -uo pipefail

cd "$(dirname "$0")/.."

find_sanitizer() {
  if [[ -n "${COMPUTE_SANITIZER:-}" ]]; then echo "$COMPUTE_SANITIZER"; return; fi
  command -v compute-sanitizer 2>/dev/null && return
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-* /opt/cuda /opt/nvidia/hpc_sdk/*/*/cuda/*; do
    [[ -n "$d" && -x "$d/bin/compute-sanitizer" ]] && { echo "$d/bin/compute-sanitizer"; return; }
    [[ -n "$d" && -x "$d/compute-sanitizer/compute-sanitizer" ]] && { echo "$d/compute-sanitizer/compute-sanitizer"; return; }
  done
  # pip's CUDA packages (nvidia-cuda-sanitizer) ship it inside site-packages/nvidia
  python - <<'EOF' 2>/dev/null
import glob, os, site
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for p in glob.glob(os.path.join(base, "nvidia", "**", "compute-sanitizer"), recursive=True):
        if os.path.isfile(p) and os.access(p, os.X_OK):
            print(p); raise SystemExit
EOF
}

CS="$(find_sanitizer)"
if [[ -z "$CS" || ! -x "$CS" ]]; then
  echo "compute-sanitizer not found: install the CUDA toolkit (it ships in <cuda>/bin) or set COMPUTE_SANITIZER" >&2
  exit 2
fi

LOG_DIR="${LOG_DIR:-${OUT:+$OUT/compute-sanitizer}}"
LOG_DIR="${LOG_DIR:-build/compute-sanitizer}"
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/memcheck.*.log

if [[ $# -eq 0 ]]; then set -- -m gpu tests/gpu -x -q; fi

echo "$("$CS" --version | tail -1); logs in $LOG_DIR"
echo "+ $CS --tool memcheck --target-processes all ... python -m pytest $*"
start=$(date +%s)
# shellcheck disable=SC2086
"$CS" --tool memcheck --target-processes all --require-cuda-init no --launch-timeout 600 \
  --print-limit 1000 --log-file "$LOG_DIR/memcheck.%p.log" ${COMPUTE_SANITIZER_FLAGS:-} \
  python -m pytest "$@"
rc=$?
elapsed=$(( $(date +%s) - start ))

python - "$LOG_DIR" "$rc" "$elapsed" <<'EOF'
import glob, os, re, sys
log_dir, rc, elapsed = sys.argv[1], int(sys.argv[2]), sys.argv[3]
procs = errors = memory = api = other = 0
examples = []
for path in sorted(glob.glob(os.path.join(log_dir, "memcheck.*.log"))):
    text = open(path, errors="replace").read()
    procs += 1
    for m in re.finditer(r"ERROR SUMMARY: (\d+) error", text):
        errors += int(m.group(1))
    for line in text.splitlines():
        body = line.removeprefix("=========").strip()
        if re.match(r"(Invalid|Misaligned|Out-of-range|Address .* is out of bounds|Malloc/Free|Hardware exception|Cuda memcheck)", body, re.I) \
                or "__global__" in body or "__shared__" in body or "__local__" in body:
            memory += 1
            kind = "memory"
        elif body.startswith("Program hit"):
            api += 1
            kind = "api"
        elif body.startswith(("Error:", "Leaked")):
            other += 1
            kind = "other"
        else:
            continue
        if len(examples) < 12:
            examples.append(f"  [{kind}] {os.path.basename(path)}: {body}")
print("\n".join(examples))
print(f"compute-sanitizer memcheck: {procs} processes, {errors} errors "
      f"({memory} memory access, {api} CUDA API errors, {other} other); pytest exit {rc}; {elapsed} s")
sys.exit(0 if rc == 0 and errors == 0 and memory == 0 else 1)
EOF
