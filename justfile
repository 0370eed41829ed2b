# ft — common tasks. `pip install rust-just` provides `just`.

# Install ft with its test dependencies (torch pinned to the CPU build).
install:
    python -m pip install -e ".[test]"

# The whole test suite (what CI runs).
test:
    python -m pytest -q

# Fast tests only: everything but the real default model and the soak (`-m "not slow"`).
test-fast:
    python -m pytest -q -m "not slow"

# Serve the default model on 127.0.0.1:1941.
serve *ARGS:
    ft serve {{ARGS}}

# Output tokens/s at 1, 4 and 16 concurrent requests.
bench:
    ft bench

# Lint and type-check, as .ci/run does (ruff and mypy come with the test extra).
lint:
    python -m ruff check ft tests tools
    python -m ruff format --check ft tests tools
    python -m mypy ft
