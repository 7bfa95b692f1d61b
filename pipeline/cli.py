"""The `sluice` command.

    sluice run [--processes N] every stage and the bridge, supervised, over N processes (default: one per
                               core; `[run] processes`): the bridge and the stages in each, on one port
                               (`[run] bridges = "first"`: the bridge in the first only); each stage's
                               consumer group spreads its partitions
    sluice bridge              the bridge alone, in front of stage processes started elsewhere
    sluice worker [STAGE...]   some stages in this process (all of the profile's when none is named); a
                               kind (`decode`: every pool's) or a name (`decode.local`)
    sluice topics create       create the declared topics (idempotent)
    sluice ask "prompt"        stream an answer through the whole pipeline
    sluice keys create|rotate|revoke|list   API keys (pipeline/gateway/keys_cli.py)
    sluice cache purge --tenant T [--model M]   forget cached answers (pipeline/cache/purge_cli.py)
    sluice usage --tenant T [--since 1h]        requests, tokens and spend (pipeline/observability/usage_cli.py)
    sluice config check        validate the configuration and print it as it takes effect, secrets masked
    sluice batch submit|status|cancel|results|list|run|worker   batch jobs (pipeline/batch/cli.py)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import Callable

from pipeline import settings as settings_module
from pipeline.topology import KINDS


def main(argv: list[str] | None = None) -> int:
    """Runs one command. An error the user can fix (the configuration, a broker that is not up, a stage
    the profile lacks, a request the pipeline refuses) is one line on stderr and exit status 2; any other
    exception is a bug and keeps its traceback."""
    args = _parser().parse_args(argv)
    if args.command == "config":
        return _config_check()
    try:
        return _dispatch(args)
    except Exception as exc:
        if (line := _user_error(exc)) is None:
            raise
        if args.command in LONG_RUNNING and not isinstance(exc, settings_module.SettingsError | LookupError):
            raise  # a Kafka error hours into a run is no start-up mistake: keep where it came from
        print(f"sluice {args.command}: {line}", file=sys.stderr)
        return 2


LONG_RUNNING = ("run", "bridge", "worker")  # only their start-up errors (configuration, profile) are one line


def _user_error(exc: Exception) -> str | None:
    """The one line for an error the user can fix; None for a bug (KeyError and IndexError are
    LookupErrors too, but only code raises them)."""
    import msgspec
    from aiokafka.errors import KafkaError

    if isinstance(exc, settings_module.SettingsError):
        return f"invalid configuration: {exc}"
    if isinstance(exc, KafkaError):
        return f"Kafka: {exc} (is the broker up?)"
    if isinstance(exc, msgspec.ValidationError):
        return f"invalid request: {exc}"
    if isinstance(exc, LookupError) and not isinstance(exc, KeyError | IndexError):
        return str(exc)
    return None


def _number(kind: Callable[[str], float], low: float, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, refused (usage and exit 2) outside low..high."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:  # NaN too
            raise argparse.ArgumentTypeError(f"must be {low:g} to {high:g}, got {text}" if high < math.inf
                                             else f"must be at least {low:g}, got {text}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="an LLM request pipeline on Kafka")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every stage and the bridge, restarted if it fails")
    run.add_argument("--in-process", action="store_true", help="in this process, unsupervised")
    run.add_argument("--processes", type=_number(int, 0), default=None,
                     help="processes to spread over (default: [run] processes, 0: one per core)")
    run.add_argument("--shared-port", action="store_true",
                     help="with --in-process: the bridge's port is shared with the other processes of `sluice run` (SO_REUSEPORT)")
    sub.add_parser("bridge", help="run the bridge alone (stages run in `sluice worker` processes)")
    worker = sub.add_parser("worker", help="run the named stages (default: all of the profile's) in this process")
    worker.add_argument("stages", nargs="*", metavar="STAGE", help=f"a kind ({', '.join(KINDS)}) or a name (decode.local)")
    topics = sub.add_parser("topics", help="manage topics")
    topics.add_argument("action", choices=["create", "list"])
    ask = sub.add_parser("ask", help="stream an answer through the pipeline")
    ask.add_argument("prompt")
    ask.add_argument("--system", default=None, help="a system message")
    ask.add_argument("--max-tokens", type=_number(int, 1), default=256)  # the bounds of topics/requests.py
    ask.add_argument("--temperature", type=_number(float, 0.0, 2.0), default=0.0)
    ask.add_argument("--model", default=None)
    ask.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"),
                       help="an API key from `sluice keys create`; default $SLUICE_API_KEY (an argument is visible to every local user in ps)")
    config = sub.add_parser("config", help="check the configuration")
    config.add_argument("action", choices=["check"])
    from pipeline.batch import cli as batch_cli
    from pipeline.cache import purge_cli
    from pipeline.gateway import keys_cli
    from pipeline.observability import usage_cli

    keys_cli.add_parser(sub)
    purge_cli.add_parser(sub)
    usage_cli.add_parser(sub)
    batch_cli.add_parser(sub)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    from pipeline.batch import cli as batch_cli
    from pipeline.cache import purge_cli
    from pipeline.gateway import keys_cli
    from pipeline.observability import usage_cli

    settings = settings_module.load()

    if args.command == "run" and args.in_process:
        from pipeline.embedded import run_embedded

        run_embedded(settings, shared_port=args.shared_port)
        return 0
    if args.command == "bridge":
        from pipeline.embedded import run_embedded

        run_embedded(settings, with_stages=False)
        return 0
    if args.command == "run":
        from pipeline.supervisor import run_supervised

        return run_supervised(settings, args.processes)
    if args.command == "worker":
        from pipeline.process import run_worker

        run_worker(*args.stages)
        return 0
    if args.command == "keys":
        return asyncio.run(keys_cli.run(settings, args))
    if args.command == "cache":
        return asyncio.run(purge_cli.run(settings, args))
    if args.command == "usage":
        return asyncio.run(usage_cli.run(settings, args))
    if args.command == "batch":
        return asyncio.run(batch_cli.run(settings, args))
    if args.command == "topics":
        return asyncio.run(_topics(settings, args.action))
    return asyncio.run(_ask(settings, args))


def _config_check() -> int:
    """Prints the effective settings (file and environment) as JSON with secrets masked; exit 2 if invalid."""
    import json

    from pipeline.strict import masked

    try:
        settings = settings_module.load()
    except settings_module.SettingsError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(masked(settings), indent=2))
    return 0


async def _topics(settings: settings_module.Settings, action: str) -> int:
    from pipeline import kafka

    if action == "create":
        created = await kafka.create_topics(settings)
        print(f"created {len(created)} topics" + (f": {', '.join(created)}" if created else " (all existed)"))
    else:
        for spec in kafka.topic_specs(settings):
            print(f"{spec.name}\tpartitions={spec.partitions}\t{spec.carries}\t{spec.config}")
    return 0


async def _ask(settings: settings_module.Settings, args: argparse.Namespace) -> int:
    from pipeline.sdk import Client, RequestFailed

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
    async with Client(settings, model=args.model) as client:
        stream = client.stream(messages=messages, max_tokens=args.max_tokens, temperature=args.temperature, api_key=args.api_key)
        try:
            async for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except RequestFailed as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    done = stream.done
    assert done is not None
    timings = " ".join(f"{k}={v:.0f}ms" for k, v in done.timings.items())
    print(f"\n[{done.finish_reason}; {done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} completion tokens; {timings}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
