"""The `kivi-jax` command line. Subcommands live beside the code they drive and register here."""

from __future__ import annotations

import typer

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


# Subcommand registrations (one line each, owned by the module that implements the command).
from models.cli_generate import generate as _generate  # noqa: E402

app.command("generate")(_generate)
from models.eval.cli import eval_app as _eval_app  # noqa: E402
from models.eval.memory_cli import memory as _memory  # noqa: E402

app.add_typer(_eval_app, name="eval")
app.command("memory")(_memory)
