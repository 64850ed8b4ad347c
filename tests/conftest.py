"""Make the single-file algorithms importable from the repository root; share compiled programs between tests."""
import os
import sys
import tempfile

import jax
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# Several tests compile the very same training program (a run, its interrupted twin, the resumed run):
# a persistent compilation cache turns the repeats into cache hits. One cache per test session, shared by the
# xdist workers (which split a file's tests between them) and the subprocesses that tests start (the CLI).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
CACHE_DIR = (os.path.join(tempfile.gettempdir(), f"jax_cache_{_RUN}") if _RUN else tempfile.mkdtemp(prefix="jax_cache_"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

# Most tests run a few tiny iterations, where XLA's optimisation passes cost more time than they save
# (tests/test_run_management.py on one core: 810 s with them, 651 s without; G1's program: 143 s -> 112 s).
# The learning tests (marked slow) run long enough to gain from them and keep them on. Subprocesses started
# by tests (the CLI, 2-process runs) inherit the setting through the environment.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


@pytest.fixture(autouse=True)
def quick_compiles_unless_slow(request):
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", request.node.get_closest_marker("slow") is None)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


def pytest_collection_modifyitems(items):
    """The end-to-end learning runs (minutes each) first: with --dist worksteal (pytest.ini) the short tests then
    fill in around them on both workers, and no worker is left with one long test at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise
