"""``disagg deploy k8s|slurm``: render a many-machine deployment of a disagg YAML.

    disagg deploy k8s -c cluster.yaml [--image IMAGE] [--namespace NS] -o DIR
    disagg deploy slurm -c cluster.yaml -o job.sbatch

The YAML is the one ``disagg launch`` starts on one machine; the hosts of its ``urls`` are
ignored (the deployment places the workers), their ports are the workers' ports, and
``num_instances`` is each group's replica count. See ``disagg.deploy.k8s`` and
``disagg.deploy.slurm`` for what is rendered.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg.deploy.plan import DeployError, build_plan


def _command(target: str, args: argparse.Namespace, flags: Sequence[tuple[str, str]]) -> str:
    """The command line that renders this output (written into it): the options given."""
    words = ["disagg", "deploy", target, "-c", args.config, "-o", args.output]
    for dest, flag in flags:
        value = getattr(args, dest)
        if value is True:
            words.append(flag)
        elif value not in (None, False):
            words += [flag, str(value)]
    return shlex.join(words)


_COMMON_FLAGS = (("model", "--model"), ("drain_timeout", "--drain-timeout"), ("cpu", "--cpu"))
_K8S_FLAGS = (*_COMMON_FLAGS, ("image", "--image"), ("namespace", "--namespace"),
              ("name", "--name"), ("model_pvc", "--model-pvc"),
              ("model_host_path", "--model-host-path"), ("service_type", "--service-type"),
              ("secret", "--secret"), ("monitoring", "--monitoring"))
_SLURM_FLAGS = (*_COMMON_FLAGS, ("job_name", "--job-name"), ("time", "--time"),
                ("partition", "--partition"), ("account", "--account"),
                ("startup_timeout", "--startup-timeout"))


def run_k8s(args: argparse.Namespace) -> int:
    from disagg.deploy import k8s

    try:
        opts = k8s.K8sOptions(name=args.name or "disagg", namespace=args.namespace,
                              image=args.image, model_pvc=args.model_pvc,
                              model_host_path=args.model_host_path,
                              service_type=args.service_type or "ClusterIP",
                              secret=args.secret, monitoring=args.monitoring)
        plan = build_plan(args.config, models_dir=k8s.MODELS_DIR, absolute_only=True,
                          minimal_instances="one", model_override=args.model,
                          drain_timeout=args.drain_timeout, cpu=args.cpu)
        paths = k8s.write(plan, opts, Path(args.output), _command("k8s", args, _K8S_FLAGS))
    except (DeployError, OSError) as e:
        print(f"disagg deploy k8s: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} files to {args.output}: {', '.join(p.name for p in paths)}")
    return 0


def run_slurm(args: argparse.Namespace) -> int:
    from disagg.deploy import slurm

    try:
        opts = slurm.SlurmOptions(job_name=args.job_name or "disagg",
                                  time=args.time or "01:00:00", partition=args.partition,
                                  account=args.account,
                                  startup_timeout_s=args.startup_timeout or 1800)
        plan = build_plan(args.config, models_dir=slurm.MODELS_DIR, absolute_only=False,
                          minimal_instances="all", model_override=args.model,
                          drain_timeout=args.drain_timeout, cpu=args.cpu)
        path = slurm.write(plan, opts, Path(args.output),
                           _command("slurm", args, _SLURM_FLAGS))
    except (DeployError, OSError) as e:
        print(f"disagg deploy slurm: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} (submit it with: sbatch {path})")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, metavar="FILE",
                   help="the disagg YAML (as for disagg launch)")
    p.add_argument("--model", metavar="PATH|tiny|smollm2",
                   help="model of every worker group, replacing the YAML's")
    p.add_argument("--drain-timeout", type=float, metavar="S",
                   help="seconds a stopping worker gets to finish its requests (default: the "
                        "YAML's drain_timeout, else 30)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU nodes: request no GPUs (default: tp*pp GPUs a worker unless its "
                        "device is cpu)")


def add_cli(sub: Any) -> None:
    p = sub.add_parser("deploy", help="render Kubernetes manifests or a Slurm job from a "
                                      "disagg YAML",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = p.add_subparsers(dest="target", metavar="TARGET")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    k = targets.add_parser("k8s", help="Kubernetes manifests (a folder)",
                           description="Render Kubernetes manifests: router Deployment + "
                                       "Service, a Deployment per worker group, a ConfigMap.")
    _common(k)
    k.add_argument("-o", "--output", required=True, metavar="DIR", help="output folder")
    k.add_argument("--image", help="container image (default: disagg:VERSION, or "
                                   "disagg:VERSION-cuda when workers use GPUs; see deploy/docker)")
    k.add_argument("--namespace", metavar="NS", help="namespace of every object (default: "
                                                     "kubectl's current one)")
    k.add_argument("--name", metavar="NAME", help="prefix of the objects' names (default disagg)")
    vol = k.add_mutually_exclusive_group()
    vol.add_argument("--model-pvc", metavar="CLAIM", help="a PersistentVolumeClaim holding the "
                     "model, mounted read-only at the model path")
    vol.add_argument("--model-host-path", metavar="DIR", help="a folder of every node holding "
                     "the model, mounted read-only at the model path")
    k.add_argument("--service-type", choices=("ClusterIP", "NodePort", "LoadBalancer"),
                   help="the router Service's type (default ClusterIP)")
    k.add_argument("--secret", action="store_true",
                   help="also write secret.yaml with a fresh random cluster token (default: "
                        "create the Secret with kubectl, as the rendered README says)")
    k.add_argument("--monitoring", action="store_true",
                   help="also write monitoring.yaml: a prometheus-operator PodMonitor per "
                        "component and the Grafana dashboard in a ConfigMap labelled "
                        "grafana_dashboard: \"1\" (deploy/grafana/README.md)")
    k.set_defaults(func=run_k8s)

    s = targets.add_parser("slurm", help="an sbatch script",
                           description="Render an sbatch script: the router on the first "
                                       "node, each worker on a node of its own.")
    _common(s)
    s.add_argument("-o", "--output", required=True, metavar="FILE", help="the script to write")
    s.add_argument("--job-name", help="sbatch --job-name (default disagg)")
    s.add_argument("--time", help="sbatch --time (default 01:00:00)")
    s.add_argument("--partition", help="sbatch --partition")
    s.add_argument("--account", help="sbatch --account")
    s.add_argument("--startup-timeout", type=int, metavar="S",
                   help="seconds for every worker to load and register (default 1800)")
    s.set_defaults(func=run_slurm)
