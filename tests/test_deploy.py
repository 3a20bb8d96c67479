"""deploy/: the TFJob and PyTorchJob manifests and the SLURM batch script.

Each test builds the environment the cluster manager really gives a process -- what Kubeflow's
training-operator (``kubeflow.org/v1``, release 1.9: ``pkg/controller.v1/tensorflow/tensorflow.go``
``genTFConfigJSONStr``/``genClusterSpec``, ``pkg/controller.v1/pytorch/envvar.go`` ``setPodEnv`` and
``master.go``) puts into each pod, and what ``srun`` exports to each task -- from the manifest itself,
feeds it to ``meshfit.cluster.resolve_cluster`` (what ``MultiWorkerMirroredStrategy()`` calls) and
asserts the roles.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest

from meshfit.cluster import (
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    expand_hostlist,
    resolve_cluster,
)

yaml = pytest.importorskip("yaml", reason="PyYAML is a test extra: pip install -e '.[test]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
IMAGE = "meshfit/seed-cnn:0.1.0"
PORT = 29500


def _load(name: str) -> dict:
    with open(os.path.join(DEPLOY, name)) as f:
        return yaml.safe_load(f)


def _container(replica_spec: dict, name: str) -> dict:
    containers = replica_spec["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def _port(container: dict, port_name: str, default: int) -> int:
    """The operator's ``GetPortFromTFJob`` / ``getPortFromPyTorchJob``: the named container port."""
    return next((p["containerPort"] for p in container.get("ports", []) if p["name"] == port_name), default)


def _user_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


# ---- what the training-operator sets ------------------------------------------------------------

def tfjob_environments(job: dict, namespace: str = "default") -> dict[tuple[str, int], dict[str, str]]:
    """``{(replica type, index): environment}`` for every pod of a TFJob, as the operator makes it.

    ``genClusterSpec``: every replica type (chief, worker, evaluator, ps alike) becomes a lower-cased
    job listing ``<name>-<type>-<i>.<namespace>.svc:<tfjob-port>``; ``genTFConfigJSONStr``: Go's
    ``json.Marshal`` of ``{cluster, task: {type, index}, environment: "cloud"}`` (map keys sorted,
    no spaces), appended to the container's own env.
    """
    name, specs = job["metadata"]["name"], job["spec"]["tfReplicaSpecs"]
    cluster = {}
    for rtype, spec in specs.items():
        rt = rtype.lower()
        port = _port(_container(spec, "tensorflow"), "tfjob-port", 2222)
        cluster[rt] = [f"{name}-{rt}-{i}.{namespace}.svc:{port}" for i in range(spec.get("replicas", 1))]
    cluster = dict(sorted(cluster.items()))
    environments = {}
    for rtype, spec in specs.items():
        for i in range(spec.get("replicas", 1)):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": rtype.lower(), "index": i},
                                    "environment": "cloud"}, separators=(",", ":"))
            env = _user_env(_container(spec, "tensorflow"))
            env["TF_CONFIG"] = tf_config
            environments[(rtype.lower(), i)] = env
    return environments


def pytorchjob_environments(job: dict) -> dict[tuple[str, int], dict[str, str]]:
    """``{(replica type, index): environment}`` for every pod of a PyTorchJob (``setPodEnv``).

    PYTHONUNBUFFERED=1; MASTER_PORT/PET_MASTER_PORT (the master's ``pytorchjob-port``) and
    MASTER_ADDR/PET_MASTER_ADDR (``<name>-master-0``); WORLD_SIZE = replicas × nprocPerNode (1 unless
    an integer); RANK = PET_NODE_RANK = index (workers + 1); PET_NPROC_PER_NODE (defaulted to "auto");
    PET_NNODES = replicas (no elastic policy).
    """
    name, specs, spec_top = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"], job["spec"]
    total = sum(s.get("replicas", 1) for s in specs.values())
    nproc_text = str(spec_top.get("nprocPerNode", "auto"))
    nproc = int(nproc_text) if nproc_text.isdigit() else 1
    master_port = _port(_container(specs["Master"], "pytorch"), "pytorchjob-port", 23456)
    master_addr = f"{name}-master-0"
    environments = {}
    for rtype, spec in specs.items():
        for i in range(spec.get("replicas", 1)):
            rank = i + 1 if rtype == "Worker" else i
            env = _user_env(_container(spec, "pytorch"))
            env.update({"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(master_port),
                        "PET_MASTER_PORT": str(master_port), "MASTER_ADDR": master_addr,
                        "PET_MASTER_ADDR": master_addr, "WORLD_SIZE": str(total * nproc),
                        "RANK": str(rank), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc_text,
                        "PET_NNODES": str(total)})
            environments[(rtype.lower(), i)] = env
    return environments


# ---- what srun sets -----------------------------------------------------------------------------

def _sbatch_text() -> str:
    with open(os.path.join(DEPLOY, "slurm.sbatch")) as f:
        return f.read()


def _sbatch_option(text: str, option: str) -> int:
    match = re.search(rf"^#SBATCH --{option}=(\d+)$", text, re.M)
    assert match, f"#SBATCH --{option} missing"
    return int(match.group(1))


def _script_default(text: str, variable: str) -> str:
    match = re.search(rf'^export {variable}="\$\{{{variable}:-([^}}]*)\}}"', text, re.M)
    assert match, f"export {variable} missing"
    return match.group(1)


def srun_environments(nodelist: str, tasks_per_node: int, job_id: int = 4242,
                      cpus_per_task: int = 1) -> list[dict[str, str]]:
    """The ``SLURM_*`` environment of every task of ``srun`` in a batch job (block distribution)."""
    hosts = expand_hostlist(nodelist)
    nodes, ntasks = len(hosts), len(hosts) * tasks_per_node
    script = _sbatch_text()
    common = {
        "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": "meshfit-seed-cnn",
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node),
        "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node),
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_CPUS_PER_TASK": str(cpus_per_task),
        "SLURM_CPUS_ON_NODE": str(cpus_per_task * tasks_per_node), "SLURM_DISTRIBUTION": "block",
        "SLURM_SUBMIT_DIR": "/home/user/meshfit", "SLURM_SUBMIT_HOST": "login1",
        "SLURM_CLUSTER_NAME": "cluster", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
        "SLURM_SRUN_COMM_HOST": "10.0.0.1", "SLURM_SRUN_COMM_PORT": "41234", "SLURM_PRIO_PROCESS": "0",
        "SLURM_UMASK": "0022", "SLURM_JOB_PARTITION": "batch", "SLURM_MPI_TYPE": "pmix",
        # what the batch script itself exports before srun
        "MESHFIT_MASTER_PORT": _script_default(script, "MESHFIT_MASTER_PORT"),
        "OMP_NUM_THREADS": str(cpus_per_task),
    }
    environments = []
    for procid in range(ntasks):
        node = procid // tasks_per_node
        gtids = ",".join(str(node * tasks_per_node + k) for k in range(tasks_per_node))
        environments.append({**common, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % tasks_per_node),
                             "SLURM_NODEID": str(node), "SLURMD_NODENAME": hosts[node],
                             "SLURM_TOPOLOGY_ADDR": hosts[node], "SLURM_GTIDS": gtids})
    return environments


# ---- tests ---------------------------------------------------------------------------------------

def test_tfjob_environment_generator_matches_the_operator():
    """The generator reproduces the operator's own expected TF_CONFIG (pod_test.go, evaluator + ps case)."""
    job = {"metadata": {"name": "test-tfjob"}, "spec": {"tfReplicaSpecs": {
        rtype: {"replicas": 1, "template": {"spec": {"containers": [{"name": "tensorflow", "image": "x"}]}}}
        for rtype in ("Worker", "PS", "Evaluator")}}}
    expected = ('{"cluster":{"evaluator":["test-tfjob-evaluator-0.ns3.svc:2222"],"ps":["test-tfjob-ps-0.ns3.svc:2222"],'
                '"worker":["test-tfjob-worker-0.ns3.svc:2222"]},"task":{"type":"worker","index":0},'
                '"environment":"cloud"}')
    assert tfjob_environments(job, namespace="ns3")[("worker", 0)]["TF_CONFIG"] == expected


def test_tfjob_roles():
    job = _load("tfjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    envs = tfjob_environments(job)
    assert sorted(envs) == [("chief", 0), ("evaluator", 0), ("worker", 0), ("worker", 1)]
    master = "meshfit-seed-cnn-chief-0.default.svc"
    expected = {("chief", 0): (0, True), ("worker", 0): (1, False), ("worker", 1): (2, False),
                ("evaluator", 0): (None, False)}
    for key, env in envs.items():
        resolver = resolve_cluster(env)
        assert isinstance(resolver, TFConfigClusterResolver), key
        assert (resolver.task_type, resolver.task_id) == key
        assert (resolver.rank, resolver.is_chief) == expected[key], key
        assert (resolver.world_size, resolver.num_workers) == (3, 2), key  # the evaluator does not train
        assert (resolver.master_addr, resolver.master_port) == (master, PORT), key
        assert resolver.init_method == f"tcp://{master}:{PORT}"
        assert env["OMP_NUM_THREADS"] == "1"


def test_pytorchjob_roles():
    job = _load("pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    envs = pytorchjob_environments(job)
    assert sorted(envs) == [("master", 0), ("worker", 0), ("worker", 1)]
    ranks = {("master", 0): 0, ("worker", 0): 1, ("worker", 1): 2}
    for key, env in envs.items():
        assert "LOCAL_RANK" not in env  # plain `python`, not torchrun: the operator does not set it
        resolver = resolve_cluster(env)
        assert isinstance(resolver, TorchrunClusterResolver), key
        assert (resolver.rank, resolver.world_size, resolver.is_chief) == (ranks[key], 3, ranks[key] == 0), key
        assert (resolver.master_addr, resolver.master_port) == ("meshfit-seed-cnn-master-0", PORT), key
        assert resolver.local_rank is None


def test_pytorchjob_under_torchrun_reads_local_rank():
    """Should a user switch the command to torchrun, torchrun adds LOCAL_RANK and keeps the rest."""
    env = dict(pytorchjob_environments(_load("pytorchjob.yaml"))[("worker", 1)], LOCAL_RANK="0")
    resolver = resolve_cluster(env)
    assert (resolver.rank, resolver.local_rank, resolver.world_size) == (2, 0, 3)


@pytest.mark.parametrize("nodelist, tasks_per_node, hosts", [
    ("node[01-03,7]", 1, ["node01", "node02", "node03", "node7"]),
    ("gpu[3,10-11],login-a", 2, ["gpu3", "gpu10", "gpu11", "login-a"]),
])
def test_slurm_roles(nodelist, tasks_per_node, hosts):
    envs = srun_environments(nodelist, tasks_per_node)
    assert len(envs) == len(hosts) * tasks_per_node
    for procid, env in enumerate(envs):
        resolver = resolve_cluster(env)
        assert isinstance(resolver, SlurmClusterResolver)
        assert (resolver.rank, resolver.world_size, resolver.is_chief) == (procid, len(envs), procid == 0)
        assert resolver.local_rank == procid % tasks_per_node
        assert (resolver.master_addr, resolver.master_port) == (hosts[0], PORT)
        assert env["SLURMD_NODENAME"] == hosts[procid // tasks_per_node]


def test_slurm_script_matches_srun_environment_of_its_own_header():
    text = _sbatch_text()
    nodes, per_node = _sbatch_option(text, "nodes"), _sbatch_option(text, "ntasks-per-node")
    envs = srun_environments(f"node[01-{nodes:02d}]", per_node)
    assert [resolve_cluster(e).rank for e in envs] == list(range(nodes * per_node))
    subprocess.run(["bash", "-n", os.path.join(DEPLOY, "slurm.sbatch")], check=True, timeout=30)


def _sbatch_command(text: str) -> list[str]:
    """The argv the batch script's srun runs, with ``$SHARED`` as inside the container (/shared)."""
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("python "))
    return shlex.split(line.replace("$SHARED", "/shared"))


def test_manifests_name_the_same_image_command_and_port():
    tfjob, pytorchjob = _load("tfjob.yaml"), _load("pytorchjob.yaml")
    containers = ([_container(s, "tensorflow") for s in tfjob["spec"]["tfReplicaSpecs"].values()]
                  + [_container(s, "pytorch") for s in pytorchjob["spec"]["pytorchReplicaSpecs"].values()])
    assert {c["image"] for c in containers} == {IMAGE}
    commands = {tuple(c["command"]) for c in containers}
    text = _sbatch_text()
    assert commands == {tuple(_sbatch_command(text))}
    command = next(iter(commands))
    assert command[:2] == ("python", "examples/main.py")
    with open(os.path.join(ROOT, command[1])) as f:
        source = f.read()
    for flag in command[2::2]:
        assert f'"{flag}"' in source, f"examples/main.py has no {flag} option"
    ports = {_port(c, "tfjob-port", 2222) for c in containers[:3]} | \
        {_port(c, "pytorchjob-port", 23456) for c in containers[3:]}
    assert ports == {PORT}
    assert int(_script_default(text, "MESHFIT_MASTER_PORT")) == PORT
    assert IMAGE in text  # the script's container option names the same image
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        assert f"-t {IMAGE}" in f.read()


def test_elastic_pytorchjob_runs_torchrun_with_the_recipe():
    """deploy/pytorchjob-elastic.yaml: torchrun's elastic agent, c10d rendezvous, MIN:MAX workers, a short
    last call (fast restarts), and the shared-store workaround for scale-up (pytorch#135712, #139702)."""
    job = _load("pytorchjob-elastic.yaml")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["minReplicas"] < policy["maxReplicas"]
    assert policy["maxRestarts"] > 0
    assert {c["key"]: c["value"] for c in policy["rdzvConf"]}["last_call_timeout"] == "1"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert "Master" not in job["spec"]["pytorchReplicaSpecs"]  # elastic jobs have workers only
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    container = _container(worker, "pytorch")
    assert container["command"][0] == "torchrun"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
