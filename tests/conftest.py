"""pytest fixtures shared by the test modules; the doubles themselves live in doubles.py."""

import pytest

from doubles import nanochat_tokenizer

tok = pytest.fixture(scope="session", name="tok")(nanochat_tokenizer)
