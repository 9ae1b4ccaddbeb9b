"""The `kivi-jax` command line (the console script `kivi-jax = models.cli:app`).

It lives in the application package, not in `kivi_jax`: the library must not import `models`
(tests/test_layering.py checks it). Each subcommand lives beside the code it drives and is
registered here.
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

try:  # newer typer carries its own copy of click, whose exceptions its parser raises
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer runs on click itself
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError

from models.cli_generate import generate as _generate
from models.eval.cli import eval_app as _eval_app
from models.eval.memory_cli import memory as _memory


class _Commands(TyperGroup):
    """The top-level group. A usage error that click finds itself (an unknown flag or command,
    a value of the wrong type, a missing argument) is reported as the commands' own checks are
    (`models.cli_checks.fail`): one `error:` line on stderr and status 2, not a framed panel."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        run = lambda: super(_Commands, self).main(
            args, prog_name, complete_var, standalone_mode=False, **extra
        )
        if not standalone_mode:  # a caller that handles click's exceptions itself
            return run()
        try:
            status = run()
        except NoArgsIsHelpError as e:  # bare `kivi-jax`: the help text
            e.show()
            sys.exit(e.exit_code)
        except UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            typer.echo(f"error: {e.format_message()}{hint}", err=True)
            sys.exit(2)
        except ClickException as e:
            typer.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:  # end of input at a prompt
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        # run() returns the status of an explicit exit (typer.Exit, Ctrl-C's 130) or the
        # command's own return value (None)
        sys.exit(status if isinstance(status, int) else 0)


app = typer.Typer(
    cls=_Commands,
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
