"""The ``fiberserve`` command line: serve | generate | fetch | bench.

Flags are generated from the config dataclasses, so every engine and server
setting is a flag (``--max-batch-tokens``), a ``--config`` file key
(``max_batch_tokens`` or ``max-batch-tokens``), and a field, with one name.
Flags win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from pathlib import Path

from fiberserve.config import EngineConfig, ServerConfig

SECRET = {"api_key"}


def _help(cls, name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_fields(parser: argparse.ArgumentParser, cls) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        hint = hints[f.name]
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType)  # X | None: X
        base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
        default = f.default if isinstance(f.default_factory, dataclasses._MISSING_TYPE) else f.default_factory()
        shown = "" if f.name in SECRET or default is None else f" (default: {default})"
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata["help"] + shown}
        if f.metadata["choices"]:
            kwargs["choices"] = f.metadata["choices"]
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is tuple:
            kwargs["nargs"] = "*"
        else:
            kwargs["type"] = base
        parser.add_argument(_flag(f.name), **kwargs)


def _read_config_file(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of flag names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _build(cls, values: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    chosen = {}
    for k in names & values.keys():
        v = values[k]
        chosen[k] = tuple(v) if isinstance(v, list) else v
    return cls(**chosen)


def server_config(values: dict) -> ServerConfig:
    """A ServerConfig from flag/file values; environment fallbacks are applied here only."""
    known = {f.name for f in dataclasses.fields(EngineConfig)} | {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = set(values) - known
    if unknown:
        raise SystemExit(f"unknown settings: {', '.join(sorted(unknown))}")
    if "api_key" not in values and os.environ.get("FIBERSERVE_API_KEY"):
        values["api_key"] = os.environ["FIBERSERVE_API_KEY"]
    try:
        config = _build(ServerConfig, values)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    config.engine = _build(EngineConfig, values)
    return config


def _settings(args: argparse.Namespace) -> dict:
    values = _read_config_file(args.config) if getattr(args, "config", None) else {}
    values.update(
        {
            k: v
            for k, v in vars(args).items()
            if k not in ("command", "config", "prompt", "max_new_tokens", "temperature", "chat")
        }
    )
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fiberserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the HTTP APIs")
    serve.add_argument("--config", help="a YAML or JSON file whose keys are these flags; flags win over it")
    _add_fields(serve, EngineConfig)
    _add_fields(serve, ServerConfig)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--config", help="a YAML or JSON file of engine settings")
    _add_fields(gen, EngineConfig)

    fetch = sub.add_parser("fetch", help="download, verify and cache the embedded default model")
    fetch.add_argument(
        "--cache-dir", dest="cache_dir", default=argparse.SUPPRESS, help=_help(EngineConfig, "cache_dir")
    )

    bench = sub.add_parser(
        "bench", help="load generator and peer comparison (see fiberserve bench --help)", add_help=False
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    if args.command == "bench":
        try:
            from fiberserve.bench.cli import main as bench_main
        except ImportError as exc:
            raise SystemExit(f"fiberserve bench needs its extra: pip install 'fiberserve[bench]' ({exc})") from None
        return bench_main(args.rest)
    if args.command == "fetch":
        from fiberserve.model.assets import fetch_default_model

        cache = getattr(args, "cache_dir", None) or str(EngineConfig().cache_dir)
        print(fetch_default_model(cache))
        return 0
    config = server_config(_settings(args))
    if args.command == "serve":
        if config.replicas > 0:
            from fiberserve.cluster.ray_serve import run_cluster

            return run_cluster(config)
        from fiberserve.startup import BackgroundLoad, configure_logging

        configure_logging(config.log_level)
        loading = BackgroundLoad(config.engine)  # on its own core while the web framework is imported
        from fiberserve.server import run_server

        return run_server(config, loading)
    from fiberserve import LLM, SamplingParams

    with LLM(config=config.engine) as llm:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate([args.prompt], params)[0]
    print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
