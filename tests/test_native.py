"""The native (C++) test layer, built and run from pytest:

- the unit tests (one executable per core concept: every gpumem_native_test() of
  tests/native/CMakeLists.txt) and the fuzz corpus replayed (plus random inputs) under
  AddressSanitizer + UBSan;
- the same unit tests and the corpus (plus fewer random inputs) in a debug build that runs the pool's
  invariant checker after every pool operation (-DGPUMEM_VALIDATE_EVERY_OP=ON, -O1 with libstdc++'s
  assertions): about 45 s to build and 20 s to run on 2 cores;
- stress_threads (8 threads, several streams, random sizes) under ThreadSanitizer;
- a short coverage-guided libFuzzer run of fuzz_pool, when clang is installed.

Builds are cached under build/native-asan, build/native-validate, build/native-tsan and
build/native-fuzz; only the targets needed are built, with -j2. Environment knobs:
GPUMEM_FUZZ_SECONDS (default 60) for the libFuzzer run, GPUMEM_STRESS_OPS (default 20000 per thread)
for the TSan stress test.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "tests" / "native"
CORPUS = NATIVE / "corpus"
# The unit test executables, as tests/native/CMakeLists.txt declares them.
UNIT_TESTS = re.findall(r"^gpumem_native_test\((\w+)", (NATIVE / "CMakeLists.txt").read_text(), re.M)

CMAKE = shutil.which("cmake")
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
CLANGXX = shutil.which("clang++") or next(
    (shutil.which(f"clang++-{v}") for v in range(20, 13, -1) if shutil.which(f"clang++-{v}")), None)

pytestmark = pytest.mark.skipif(
    CMAKE is None or CXX is None,
    reason=f"native tests need cmake and a C++ compiler (cmake: {CMAKE}, c++: {CXX}); "
           "install them with: apt-get install -y cmake g++",
)

ASAN_FLAGS = "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
TSAN_FLAGS = "-fsanitize=thread -fno-omit-frame-pointer"
SAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    "TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1",
}


def _run(cmd, timeout, env=None, cwd=None):
    full_env = dict(os.environ, **SAN_ENV, **(env or {}))
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    return proc.returncode, out


def _build(name, cxx_flags, targets, compiler=None, build_type="RelWithDebInfo", options=()):
    build = ROOT / "build" / f"native-{name}"
    cfg = [CMAKE, "-S", ROOT, "-B", build, "-DGPUMEM_BUILD_PYTHON=OFF", "-DGPUMEM_BUILD_NATIVE=ON",
           "-DGPUMEM_WERROR=ON",
           f"-DCMAKE_BUILD_TYPE={build_type}", f"-DCMAKE_CXX_FLAGS={cxx_flags}", *options]
    if compiler:
        cfg.append(f"-DCMAKE_CXX_COMPILER={compiler}")
    rc, out = _run(cfg, timeout=300)
    assert rc == 0, f"cmake configure of {build} failed:\n{out[-4000:]}"
    rc, out = _run([CMAKE, "--build", build, "-j2", "--target", *targets], timeout=900)
    assert rc == 0, f"build of {targets} in {build} failed:\n{out[-6000:]}"
    return build / "tests" / "native"


def _tsan_prefix():
    """TSan maps its shadow at fixed addresses; kernels with 32-bit mmap randomisation break that
    ("unexpected memory mapping"). Running with ASLR off (setarch -R) avoids it."""
    setarch = shutil.which("setarch")
    return [setarch, os.uname().machine, "-R"] if setarch else []


@pytest.fixture(scope="module")
def asan_bin():
    return _build("asan", ASAN_FLAGS, ["native_unit_tests", "fuzz_replay"])


@pytest.fixture(scope="module")
def validate_bin():
    return _build("validate", "-O1 -D_GLIBCXX_ASSERTIONS", ["native_unit_tests", "fuzz_replay"],
                  build_type="Debug", options=["-DGPUMEM_VALIDATE_EVERY_OP=ON"])


@pytest.fixture(scope="module")
def tsan_bin():
    return _build("tsan", TSAN_FLAGS, ["stress_threads"])


@pytest.fixture(scope="module")
def fuzz_bin():
    if CLANGXX is None:
        pytest.skip("clang is not installed, so there is no libFuzzer: apt-get install -y clang "
                    "(the corpus still runs through fuzz_replay under ASan+UBSan)")
    # fuzzer-no-link instruments gpumem_core too: coverage must come from the pool, not the harness.
    return _build("fuzz", ASAN_FLAGS + " -fsanitize=fuzzer-no-link", ["fuzz_pool"], compiler=CLANGXX)


def _run_unit_tests(binary, timeout=300):
    """Runs one unit test executable; returns its output, which must close on 'N passed, 0 failed'."""
    rc, out = _run([binary], timeout=timeout)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert rc == 0 and re.fullmatch(r"[1-9]\d* passed, 0 failed", last), out[-6000:]
    return out


def test_every_native_test_source_is_built():
    cmake = (NATIVE / "CMakeLists.txt").read_text()
    declared = " ".join(re.findall(r"^gpumem_native_test\(([^)]*)\)", cmake, re.M))
    assert len(UNIT_TESTS) >= 6 and "pool_tests" in UNIT_TESTS, UNIT_TESTS
    missing = [p.name for p in sorted(NATIVE.glob("test_*.cpp")) if p.name not in declared.split()]
    assert not missing, f"{missing} are in tests/native but no gpumem_native_test() builds them"


@pytest.mark.parametrize("name", UNIT_TESTS)
def test_unit_tests_under_asan_ubsan(asan_bin, name):
    out = _run_unit_tests(asan_bin / name)
    print(f"{name}: {out.strip().splitlines()[-1]}")


def test_fuzz_corpus_and_random_inputs_replay_under_asan_ubsan(asan_bin, tmp_path):
    assert CORPUS.is_dir() and any(CORPUS.iterdir()), f"the seed corpus {CORPUS} is missing"
    rc, out = _run([asan_bin / "fuzz_replay", CORPUS, "--random", "400", "--seed", "7"], timeout=300,
                   cwd=tmp_path)
    assert rc == 0 and "0 failures" in out, out[-6000:]
    print(out.strip().splitlines()[-1])


def test_validate_after_every_operation(validate_bin, tmp_path):
    """The debug build checks every invariant inside every pool call: a violation fails the call that
    caused it rather than the next validate() a test happens to make."""
    for name in UNIT_TESTS:
        out = _run_unit_tests(validate_bin / name)
        assert "validate() after every pool operation: on" in out, out[-2000:]
    rc, out = _run([validate_bin / "fuzz_replay", CORPUS, "--random", "100", "--seed", "11"], timeout=300,
                   cwd=tmp_path)
    assert rc == 0 and "0 failures" in out, out[-6000:]
    print(out.strip().splitlines()[-1])


def test_stress_threads_under_tsan(tsan_bin):
    ops = os.environ.get("GPUMEM_STRESS_OPS", "20000")
    cmd = [*_tsan_prefix(), tsan_bin / "stress_threads", "--threads", "8", "--ops", ops]
    rc, out = _run(cmd, timeout=600)
    if rc != 0 and "setarch" in out and "not permitted" in out:  # a sandbox that forbids personality()
        rc, out = _run(cmd[3:], timeout=600)
    if rc != 0 and "unexpected memory mapping" in out:
        pytest.fail("TSan cannot map its shadow memory (kernel mmap randomisation; ASLR could not be "
                    "turned off):\n" + out[-2000:])
    assert rc == 0 and "stress_threads: OK" in out and "WARNING: ThreadSanitizer" not in out, out[-8000:]
    print(out.strip().splitlines()[-1])


def test_libfuzzer_short_run(fuzz_bin, tmp_path):
    seconds = int(os.environ.get("GPUMEM_FUZZ_SECONDS", "60"))
    work = tmp_path / "corpus"
    shutil.copytree(CORPUS, work)  # new inputs go to the copy; the repository's corpus stays as it is
    cmd = [fuzz_bin / "fuzz_pool", work, f"-max_total_time={seconds}", "-max_len=2048", "-timeout=30",
           "-rss_limit_mb=2048", "-print_final_stats=1", f"-artifact_prefix={tmp_path}/"]
    rc, out = _run(cmd, timeout=seconds + 240)
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "leak-", "timeout-")))
    assert rc == 0 and not crashes, f"libFuzzer found {crashes}:\n{out[-8000:]}"
    execs = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    assert execs and int(execs.group(1)) > 0, out[-4000:]
    print(f"libFuzzer: {execs.group(1)} inputs executed in {seconds} s, 0 failures", file=sys.stderr)
