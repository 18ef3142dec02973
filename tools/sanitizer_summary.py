"""Summarise compute-sanitizer memcheck logs and judge the run (tools/compute_sanitizer.sh calls it).

    python tools/sanitizer_summary.py LOG_DIR PYTEST_EXIT SECONDS

Reads every LOG_DIR/memcheck.*.log and prints one line per kind of finding, then the summary line.
Exit status 0 only when pytest passed and the logs hold no memory-access error, no CUDA API error other
than "out of memory" (the OOM tests provoke those on purpose; they are counted apart), nothing else the
tool calls an error, no kernel launch the tool could not track (a launch it did not track, e.g. for
lack of device memory, is one it did not check), and every log complete (ends with its ERROR SUMMARY).
"""
import collections
import glob
import os
import re
import sys

OOM = ("CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation")
# the first line of each memory report; the lines under it (at, by thread, Address ...) are its detail
MEMORY = re.compile(r"(Invalid|Misaligned|Out-of-range|Malloc/Free|Hardware exception|Cuda memcheck|Warp|Lane)",
                    re.I)
API = re.compile(r"Program hit (\S+) .* on CUDA API call to (\S+?)\.?$")


def main(argv):
    log_dir, rc, elapsed = argv[0], int(argv[1]), argv[2]
    errors = memory = other = untracked = incomplete = 0
    api = collections.Counter()  # (error, call) -> count
    examples = []
    logs = sorted(glob.glob(os.path.join(log_dir, "memcheck.*.log")))
    for path in logs:
        with open(path, errors="replace") as f:
            text = f.read()
        counts = re.findall(r"ERROR SUMMARY: (\d+) error", text)
        if not counts:  # the tool did not finish (killed, timed out): what it checked is unknown
            incomplete += 1
            examples.append(f"  [incomplete] {os.path.basename(path)}: no ERROR SUMMARY line")
        errors += sum(int(n) for n in counts)
        for line in text.splitlines():
            body = line.removeprefix("=========").strip()
            if MEMORY.match(body):
                memory += 1
                examples.append(f"  [memory] {body}")
            elif m := API.match(body):
                api[m.groups()] += 1
            elif body.startswith("Internal Sanitizer Error") and "didn't track the launch" in body:
                untracked += 1  # the tool itself ran short (of device memory, say)
                if untracked <= 3:
                    examples.append(f"  [untracked] {body[:300]}")
            elif body.startswith(("Error:", "Leaked")):
                other += 1
                examples.append(f"  [other] {body}")
    for line in examples[:20]:
        print(line)
    for (err, call), n in api.most_common():
        print(f"  [api] {n} x {err} from {call}" + ("  (out of memory: expected from the OOM tests)" if err in OOM else ""))
    unexpected = sum(n for (err, _), n in api.items() if err not in OOM)
    if not logs:
        print(f"  [incomplete] no memcheck.*.log in {log_dir}: the tool checked nothing")
    print(f"compute-sanitizer memcheck: {errors} errors in {len(logs)} log(s) over every process the run started "
          f"({memory} memory access, {sum(api.values())} CUDA API errors of which {unexpected} not out-of-memory, "
          f"{other} other, {untracked} kernel launches the tool could not track); pytest exit {rc}; {elapsed} s")
    clean = logs and not incomplete and memory == other == unexpected == untracked == 0
    return 0 if rc == 0 and clean else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
