"""The `kivi-jax` command line (the console script `kivi-jax = models.cli:app`).

It lives in the application package, not in `kivi_jax`: the library must not import `models`
(tests/test_layering.py checks it). Each subcommand lives beside the code it drives and is
registered here.
"""

from __future__ import annotations

import typer

from models.cli_generate import generate as _generate
from models.eval.cli import eval_app as _eval_app
from models.eval.memory_cli import memory as _memory

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="KIVI 2/4-bit KV-cache quantization for JAX: generate, evaluate, size caches.",
)


@app.command("version")
def version() -> None:
    """Print kivi-jax, jax and jaxlib versions and the default backend."""
    import jax
    import jaxlib

    import kivi_jax

    typer.echo(
        f"kivi-jax {kivi_jax.__version__}, jax {jax.__version__}, jaxlib "
        f"{jaxlib.__version__}, backend {jax.default_backend()}"
    )


app.command("generate")(_generate)
app.add_typer(_eval_app, name="eval")
app.command("memory")(_memory)
