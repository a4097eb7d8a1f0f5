"""tests/newest_transformers/ needs the newest transformers: asked for by path under an older one
(the main environment), the run stops here saying where it runs, rather than failing test by test."""

import pytest
import transformers_env

if not transformers_env.is_newest():
    raise pytest.UsageError(
        f"tests/newest_transformers/ needs transformers >= {transformers_env.NEWEST_TRANSFORMERS}: "
        "run it with .venv-newest/bin/python -m pytest (`make test` creates .venv-newest)"
    )
