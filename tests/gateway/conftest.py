import pytest

from spillway.protocol.local import model_files


@pytest.fixture(scope="session")
def files():
    """The default model's files (converted from its GGUF on first use)."""
    return model_files.resolve_model(None)
