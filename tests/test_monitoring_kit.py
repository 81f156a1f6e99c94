"""docker/monitoring/ holds together without Docker: every file the compose stack mounts exists, Grafana's
provisioning points at the dashboard and the datasource it uses, and the scrape config reads the key from the
file the stack mounts. Queries are checked against a real Prometheus in tests/e2e/test_e2e_prometheus.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "docker" / "monitoring"


def compose() -> dict:
    return yaml.safe_load((KIT / "compose.yaml").read_text())


def test_compose_mounts_exist_and_services_are_there() -> None:
    services = compose()["services"]
    assert {"brine", "prometheus", "grafana"} <= set(services)
    assert services["brine"]["build"] == {"context": "../..", "dockerfile": "docker/Dockerfile"}
    assert (KIT / services["brine"]["build"]["context"] / services["brine"]["build"]["dockerfile"]).is_file()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (KIT / source).exists(), volume


def test_prometheus_reads_the_key_from_the_mounted_file() -> None:
    config = yaml.safe_load((KIT / "prometheus" / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    auth = job["authorization"]
    assert set(auth) == {"type", "credentials_file"}  # never `credentials:` inline
    services = compose()["services"]
    mount = next(v for v in services["prometheus"]["volumes"] if v.startswith("api-key:"))
    assert auth["credentials_file"].startswith(mount.split(":")[1] + "/")
    assert any(v.startswith("api-key:") for v in services["brine"]["volumes"])
    for rules in config["rule_files"]:
        assert (KIT / "prometheus" / rules).is_file()


def test_dashboard_is_provisioned_with_its_datasource() -> None:
    datasources = yaml.safe_load((KIT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    [source] = datasources["datasources"]
    provider = yaml.safe_load((KIT / "grafana/provisioning/dashboards/brine.yml").read_text())["providers"][0]
    grafana = compose()["services"]["grafana"]
    mount = next(v for v in grafana["volumes"] if v.startswith("./grafana/dashboards:"))
    assert mount.split(":")[1] == provider["options"]["path"]
    dashboard = json.loads((KIT / "grafana/dashboards/brine.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert titles == {
        "Prefix cache hit rate",
        "Prefix cache queries vs hits",
        "Time to first token",
        "Inter-token latency",
        "Running and waiting requests",
        "KV cache usage",
        "Cached blocks",
        "Evictions and preemptions",
        "Prompt and generation throughput",
    }
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])


def test_readme_monitoring_section_matches_the_kit() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    start = doc.index("\n## Monitoring\n")
    end = doc.find("\n## ", start + 1)
    section = doc[start : end if end != -1 else len(doc)]
    assert "docker compose -f docker/monitoring/compose.yaml up -d" in section
    assert "](../docker/monitoring/dashboard.png)" in section and (KIT / "dashboard.png").is_file()
    rules = yaml.safe_load((KIT / "prometheus" / "brine.rules.yml").read_text())
    names = [r["record"] for g in rules["groups"] for r in g["rules"]]
    # The table abbreviates the p90 rule as `:p90_5m` after the p50 one.
    assert all(name in section or name.endswith(":p90_5m") for name in names)
