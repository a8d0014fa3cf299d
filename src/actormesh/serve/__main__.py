"""``python -m actormesh.serve``: serve a Hugging Face model directory over OpenAI's API.

Example::

    python -m actormesh.serve --model /models/tiny --replicas 2 --tp 2 --port 8000
    curl localhost:8000/v1/models
"""

from __future__ import annotations

import logging
import sys

import click


@click.command(name="serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model", required=True, type=click.Path(exists=True, file_okay=False),
              help="directory written by save_pretrained (config, weights, tokenizer); nothing is downloaded")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(min=1), help="number of replicas")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1), help="tensor-parallel procs per replica")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(min=1), help="pipeline stages per replica")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(min=0, max=65535), help="port (0: any free port)")
@click.option("--model-name", default=None, help="the model id clients ask for (default: the directory's name)")
@click.option("--max-slots", default=16, show_default=True, type=click.IntRange(min=1), help="concurrent requests per replica")
@click.option("--max-context", default=None, type=click.IntRange(min=2), help="prompt + completion limit (default: the model's)")
@click.option("--max-replicas", default=None, type=click.IntRange(min=1),
              help="autoscale: grow up to this many replicas under load, shrink back when it passes")
@click.option("--min-replicas", default=None, type=click.IntRange(min=1), help="autoscale: the fewest replicas (default: --replicas)")
@click.option("--target-ongoing-requests", default=None, type=click.FloatRange(min=0, min_open=True),
              help="autoscale: requests (running and queued) per replica to aim for (default: --max-slots)")
@click.option("--upscale-delay-s", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="autoscale: how long the load must ask for more replicas before they are added")
@click.option("--downscale-delay-s", default=600.0, show_default=True, type=click.FloatRange(min=0),
              help="autoscale: how long it must ask for fewer before replicas are removed")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
def command(model: str, replicas: int, tp: int, pp: int, host: str, port: int, model_name: str | None,
            max_slots: int, max_context: int | None, max_replicas: int | None, min_replicas: int | None,
            target_ongoing_requests: float | None, upscale_delay_s: float, downscale_delay_s: float, log_level: str) -> None:
    """Serve MODEL with an OpenAI-compatible API: /v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics. Runs until Ctrl-C."""
    from . import Autoscaling, serve_openai

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    click.echo(f"starting {replicas} replica(s) of {tp * pp} proc(s) for {model} ...", err=True)
    options = {}
    try:
        if max_replicas is not None:
            options["autoscaling"] = Autoscaling(
                min_replicas=replicas if min_replicas is None else min_replicas, max_replicas=max_replicas,
                target_ongoing_requests=float(max_slots if target_ongoing_requests is None else target_ongoing_requests),
                upscale_delay_s=upscale_delay_s, downscale_delay_s=downscale_delay_s)
        elif min_replicas is not None or target_ongoing_requests is not None:
            raise ValueError("--min-replicas and --target-ongoing-requests autoscale, which needs --max-replicas too")
        serve_openai(model, replicas=replicas, tp=tp, pp=pp, host=host, port=port, model_name=model_name,
                     max_slots=max_slots, max_context=max_context, block=True, **options)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code."""
    try:
        command.main(args=argv, prog_name="python -m actormesh.serve", standalone_mode=False)
    except click.exceptions.Abort:
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
