"""``hvdp run``: a pure command builder over ``horovodrun``, plus a thin supervisor.

:func:`parse_run_args` (:mod:`.args`) turns ``hvdp run`` arguments into :class:`RunArgs`;
:func:`build_command` (:mod:`.command`) turns those into ``(argv, env)`` without starting
anything, so tests can check the command; :func:`run` (:mod:`.run`) starts it under
:mod:`.supervise`. Hosts come from one interface (:mod:`.hosts`: ``-H``, hostfile, Slurm,
discovery script); each rank's output and failure record reach ``hvdp run`` through
:mod:`.relay` and :mod:`.worker`; :mod:`.stop` ends a job; :mod:`.watch` reads Horovod's
text where no record exists; :mod:`.elastic` reports what the elastic driver decides.
``add_arguments`` and ``main`` make ``hvdp run`` a command of the CLI, like the others.
"""

from __future__ import annotations

from hvdp.launch.args import (
    DEFAULT_ELASTIC_TIMEOUT,
    DEFAULT_STALL_TIMEOUT,
    RunArgs,
    check_elastic_args,
    horovodrun_arity,
    parse_run_args,
    run_parser,
)
from hvdp.launch.command import THREAD_VARS, build_command, horovodrun_path, resolve_hosts
from hvdp.launch.hosts import (
    check_discovery_script,
    discovery_script_path,
    expand_nodelist,
    expand_tasks_per_node,
    parse_hostfile,
    parse_hosts,
    slurm_hosts,
)
from hvdp.launch.run import add_arguments, main, run
from hvdp.launch.watch import JobWatcher, describe_exit

__all__ = [
    "DEFAULT_ELASTIC_TIMEOUT", "DEFAULT_STALL_TIMEOUT", "THREAD_VARS", "JobWatcher", "RunArgs", "add_arguments",
    "build_command", "check_discovery_script", "check_elastic_args", "describe_exit", "discovery_script_path",
    "expand_nodelist", "expand_tasks_per_node", "horovodrun_arity", "horovodrun_path", "main", "parse_hostfile",
    "parse_hosts", "parse_run_args", "resolve_hosts", "run", "run_parser", "slurm_hosts",
]
