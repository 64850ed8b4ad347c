"""Make the single-file algorithms importable from the repository root; share compiled programs between tests."""
import os
import sys
import tempfile

import jax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# Several tests compile the very same training program (a run, its interrupted twin, the resumed run):
# a per-session persistent compilation cache turns the repeats into cache hits.
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jax_cache_"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
