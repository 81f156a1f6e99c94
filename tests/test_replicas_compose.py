"""docker/replicas/compose.yaml holds together without Docker: the replicas' command parses with `brine serve`'s
own parser, and the router subscribes to exactly the event sockets the replicas bind."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from server.cli import build_parser

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "replicas" / "compose.yaml"


def test_the_event_sockets_are_on_a_network_no_client_reaches() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services, networks = compose["services"], compose["networks"]
    for name in ("brine-1", "brine-2"):
        (net,) = services[name]["networks"]
        assert networks[net].get("internal") is True, "the replicas' network must have no way out or in"
        assert "ports" not in services[name]
    router = services["router"]
    assert set(router["networks"]) == {"clients", "replicas"} and "internal" not in networks["clients"]
    assert all(p.startswith("127.0.0.1:") for p in router["ports"]), "only the router is published"
    text = COMPOSE.read_text()
    assert "no client may reach them" in text  # the reason is said beside the setting


def test_replicas_and_router_agree() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    replicas = sorted(name for name in services if name.startswith("brine-"))
    assert replicas == ["brine-1", "brine-2"]
    for name in replicas:
        args = build_parser().parse_args(["serve", *services[name]["command"]])
        assert args.kv_events_endpoint == "tcp://0.0.0.0:5557"
        assert "ports" not in services[name], "a replica (and its event socket) must not be published"
    script = services["router"]["entrypoint"][-1]
    assert "--policy kv_aware" in script and '--api-key "$$BRINE_API_KEY"' in script
    for name in replicas:
        assert f"--kv-event-source http://{name}:8000=tcp://{name}:5557" in script
        assert f"--kv-event-replay-source http://{name}:8000=tcp://{name}:5558" in script
    block = re.search(r"--kv-event-block-size (\d+)", script)
    assert block and int(block.group(1)) == build_parser().parse_args(["serve"]).block_size
