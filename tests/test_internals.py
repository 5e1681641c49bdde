"""Every internal PyTorch API the course relies on (utils/course/internals.py) still exists in this release."""

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from utils.collective_counter import KINDS
from utils.course.internals import INTERNALS, resolve


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


# Private names reached as attributes of objects (not dotted from `torch`), which the scan below also looks for.
PRIVATE_ATTRIBUTES = (
    "_local_tensor",
    "_base",
    "_stages",
    "_stage",
    "_overloadpacket",
    "_execution_engine",
    "_parameters",
)
ROOT = Path(__file__).resolve().parent.parent


def code_of(path: Path) -> str:
    """The file's code with its comments and strings (docstrings included) blanked out."""
    tokens = [
        token._replace(string='""' if token.type == tokenize.STRING else "")
        if token.type in (tokenize.COMMENT, tokenize.STRING)
        else token
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    ]
    return tokenize.untokenize(tokens)


def private_uses(code: str) -> set[str]:
    uses = {match.group(0) for match in re.finditer(r"\btorch(?:\.\w+)*?\._[a-z]\w*", code)}
    imports = re.findall(r"from[ \t]+(torch[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w \t,]+))", code)
    for module, names in ((module, grouped or plain) for module, grouped, plain in imports):
        imported = [name.split(" as ")[0].strip() for name in names.split(",") if name.strip()]
        uses |= {f"{module}.{name}" for name in imported if "._" in module or name.startswith("_")}
    uses |= {name for name in PRIVATE_ATTRIBUTES if re.search(rf"\.{name}\b", code)}
    return uses


def test_every_private_torch_name_the_course_uses_is_listed():
    listed = " ".join(internal.name for internal in INTERNALS)
    unlisted = sorted(
        f"{path.relative_to(ROOT)}: {use}"
        for folder in ("solutions", "utils", "tests/workers")
        for path in sorted((ROOT / folder).rglob("*.py"))  # utils/lesson_NN/ too
        for use in private_uses(code_of(path))
        if use not in listed
    )
    assert not unlisted, (
        "private torch names used but not in utils/course/internals.py (add where, why and the public alternative): "
        + "; ".join(unlisted)
    )


@pytest.mark.parametrize("namespace, op", [(ns, op) for ns, ops in KINDS.items() for op in ops])
def test_every_collective_op_the_counter_recognises_still_exists(namespace, op):
    import torch.distributed  # noqa: F401  (registers the c10d ops)

    try:
        getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        pytest.fail(
            f"torch {torch.__version__} has no torch.ops.{namespace}.{op}, which utils/collective_counter.py's KINDS "
            "lists: the counter would miss that collective; update KINDS from the release's op names"
        )
