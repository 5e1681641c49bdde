"""Every internal PyTorch API the course relies on (utils/internals.py) still exists in this release."""

from pathlib import Path

import pytest
import torch

from utils.internals import INTERNALS, resolve


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda internal: internal.name)
def test_internal_api_still_exists(internal):
    if internal.name.startswith("env:"):  # an environment variable: some torch module must still read it
        variable = internal.name[4:]
        sources = Path(torch.__file__).parent.joinpath("distributed").rglob("*.py")
        found = any(variable in path.read_text(errors="ignore") for path in sources)
    else:
        try:
            resolve(internal.name)
            found = True
        except (AttributeError, ImportError):
            found = False
    assert found, (
        f"torch {torch.__version__} no longer has {internal.name}, which {internal.where} uses to {internal.why}; "
        f"the public alternative: {internal.public_alternative}"
    )
