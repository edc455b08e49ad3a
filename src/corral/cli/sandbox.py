"""`corral sandbox`: a simulated multi-node cluster on this machine."""

from __future__ import annotations

import shlex
from collections.abc import Callable

import click
from rich.table import Table

from corral.errors import CorralError
from corral.sandbox import DEFAULT_NAME, Sandbox, SandboxStatus, format_rate, present_sandboxes
from corral.ui import console, notice


def _instance_options(func: Callable) -> Callable:
    """--name and --state-dir, on every subcommand (where users type them)."""
    func = click.option(
        "--state-dir",
        envvar="CORRAL_SANDBOX_DIR",
        type=click.Path(file_okay=False),
        help="State directory [default: ~/.local/state/corral/sandbox/NAME; env CORRAL_SANDBOX_DIR].",
    )(func)
    func = click.option(
        "--name",
        envvar="CORRAL_SANDBOX",
        default=DEFAULT_NAME,
        show_default=True,
        help="Which sandbox (several can run at once) [env CORRAL_SANDBOX].",
    )(func)
    return func


def _json_option(func: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (for scripts).")(func)


def _sandbox(name: str, state_dir: str | None, prefix: str | None = None) -> Sandbox:
    return Sandbox(name=name, state_dir=state_dir, prefix=prefix)


@click.group(name="sandbox")
def sandbox() -> None:
    """A simulated multi-node cluster on this Linux machine.

    Each node has its own network namespace (eth0 on a bridge, its own
    address, optional rate limit), hostname, PID namespace, a real OpenSSH
    sshd, private ~/.ssh, /tmp, /var/tmp, /srv and /home, and its own /etc
    (the head's with the node's accounts and hosts on top); the rest of the
    filesystem (Python, your virtual environment) is shared, like machines
    booted from one image.  Needs root; `up --for USER` lets USER use it.

    \b
    Rehearse a multi-node run:
      corral sandbox up 4 --with-keys
      corral run --cluster ~/.local/state/corral/sandbox/sandbox/corral.toml examples/train_ddp.py
      corral sandbox partition node3     # pull node3's cable; `heal node3` plugs it back
      corral sandbox down
    """


@sandbox.command()
@click.argument("n", type=int, required=False)
@click.option("--rate", metavar="RATE", help="Limit every node's link, both ways (e.g. 200mbit, 1gbit; 'off' for none).")
@click.option("--ssh-port", type=int, help="Port every node's sshd listens on [default: 22].")
@click.option("--with-keys", is_flag=True, default=None, help="Authorize a head key on every node and record their host keys (ready for `corral run`).")
@click.option("--password-auth", is_flag=True, default=None, help="Allow password login for the test user `corral` (to rehearse key setup from first contact).")
@click.option("--password", help="The test user's password with --password-auth [default: corral].")
@click.option("--extra-nic", type=click.Choice(["fast", "decoy"]), multiple=True,
              help="fast: a second, unshaped network on eth1; decoy: a docker0-like 172.17.0.1/16 on every node. Repeatable.")
@click.option("--slots", type=int, help="Processes per node written to the hostfile and corral.toml [default: 2].")
@click.option("--prefix", help="Node name prefix for a new sandbox [default: node -> node1..nodeN].")
@click.option("--subnet", help="IPv4 subnet for the nodes [default: a free /24 derived from the name; a /23 above 240 nodes].")
@click.option("--share", "share", multiple=True, metavar="DIR",
              help="Mount this head directory under /tmp, /var/tmp or /srv through into every node "
                   "(like an NFS-mounted project; else those stay private per node). Repeatable.")
@click.option("--for", "for_user", metavar="USER",
              help="Let USER (not root) use the sandbox: read its files, use its head key, see its "
                   "status. Its state then lives in /var/lib/corral/sandbox/NAME. With --with-keys "
                   "USER logs in to the nodes as root: give it only to a user you would give root.")
@click.option("--mesh", is_flag=True,
              help="Also let every node log in to every other (one node key authorized everywhere, every "
                   "node's host key known), as a shared home gives a real cluster: what `corral exec "
                   "--tree` relays and sync's node-to-node chain use.")
@click.option("--slurm", is_flag=True, default=None,
              help="Also run a real Slurm cluster: munge and slurmctld on this machine, one slurmd per "
                   "node (configless). The Slurm tools reach it with SLURM_CONF=STATE_DIR/slurm/slurm.conf "
                   "(printed below; docs/sandbox.md#slurm).")
@_instance_options
@_json_option
def up(n: int | None, rate: str | None, ssh_port: int | None, with_keys: bool | None,
       password_auth: bool | None, password: str | None, extra_nic: tuple[str, ...],
       slots: int | None, prefix: str | None,
       subnet: str | None, share: tuple[str, ...], for_user: str | None, mesh: bool, slurm: bool | None,
       name: str, state_dir: str | None, as_json: bool) -> None:
    """Start a sandbox of N nodes; idempotent.

    On a running sandbox, `up` (N and flags may be left out) repairs it:
    stopped nodes start again, partitions heal, `slow` rates reset.  Settings
    that cannot change while it runs (N, port, keys, NICs...) are refused.
    """
    sb = _sandbox(name, state_dir, prefix)
    status = sb.up(n, rate=rate, ssh_port=ssh_port, with_keys=with_keys, password_auth=password_auth,
                   password=password, extra_nic=extra_nic or None, slots=slots, subnet=subnet,
                   share=share or None, for_user=for_user, slurm=slurm)
    meshed = None
    if mesh:
        from corral.sandbox.mesh import mesh as make_mesh

        meshed = make_mesh(sb)
    if as_json:
        _print_json("sandbox.status", {**status.to_dict(), "mesh": meshed})
    else:
        _render(status, next_steps=True)
        if meshed:
            console().print(f"[green]mesh:[/] every one of the {meshed} nodes logs in to every other "
                               "(one node key in each node's ~/.ssh)")


@sandbox.command()
@_instance_options
@_json_option
def down(name: str, state_dir: str | None, as_json: bool) -> None:
    """Remove the sandbox: its processes, namespaces, interfaces, /etc/hosts
    lines and state directory.  Idempotent."""
    removed = _sandbox(name, state_dir).down()
    if as_json:
        _print_json("sandbox.down", removed)
        return
    if not (removed["namespaces"] or removed["links"] or removed["hosts_block"] or removed["state_dir"]):
        console().print(f"sandbox {name}: nothing to remove")
    else:
        console().print(f"sandbox {name}: removed {len(removed['namespaces'])} node(s), "
                        f"{len(removed['links'])} interface(s)"
                        + (", its /etc/hosts block" if removed["hosts_block"] else "")
                        + (f" and {removed['state_dir']}" if removed["state_dir"] else ""))


@sandbox.command()
@_instance_options
@_json_option
def status(name: str, state_dir: str | None, as_json: bool) -> None:
    """Show the nodes (running / stopped, link up / partitioned, rate) and the files."""
    st = _sandbox(name, state_dir).status()
    if as_json:
        _print_json("sandbox.status", st.to_dict())
    else:
        _render(st, next_steps=False)


@sandbox.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("node")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- COMMAND...")
@_instance_options
@click.pass_context
def exec_(ctx: click.Context, node: str, command: tuple[str, ...], name: str, state_dir: str | None) -> None:
    """Run COMMAND inside NODE (no ssh needed); its exit code is passed through.

    \b
    Example:  corral sandbox exec node1 -- ps ax
    """
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    proc = _sandbox(name, state_dir).exec(node, argv, capture=False)
    ctx.exit(proc.returncode)


@sandbox.command(name="list")
@_json_option
def list_(as_json: bool) -> None:
    """List the sandboxes on this machine (found from namespaces and /etc/hosts)."""
    rows = []
    for name in present_sandboxes():
        try:
            st = Sandbox(name=name).status()
        except CorralError as err:  # root's, not readable by this user
            rows.append({"name": name, "state_dir": None, "nodes": None, "up": None,
                         "error": err.message})
            continue
        rows.append({"name": name, "state_dir": st.state_dir if st.exists else None,
                     "nodes": len(st.nodes), "up": st.up})
    if as_json:
        _print_json("sandbox.list", {"sandboxes": rows})
        return
    if not rows:
        console().print("no sandboxes on this machine")
        return
    table = Table(box=None, pad_edge=False)
    for col in ("name", "nodes", "up", "state dir"):
        table.add_column(col)
    for row in rows:
        if row["state_dir"]:
            where = row["state_dir"]
        elif "error" in row:
            where = "(not readable by you: sudo, or root's `up --for $USER`)"
        else:
            where = "(elsewhere: pass --state-dir to other commands)"
        table.add_row(row["name"], str(row["nodes"]) if row["state_dir"] else "?",
                      "?" if row["up"] is None else ("yes" if row["up"] else "no"), where)
    console().print(table)


def _node_command(verb: str, doc: str) -> click.Command:
    @click.argument("node")
    @_instance_options
    def command(node: str, name: str, state_dir: str | None) -> None:
        getattr(_sandbox(name, state_dir), verb)(node)
        notice(f"{node}: {_DONE[verb].format(node=node + ('' if name == DEFAULT_NAME else f' --name {name}'))}")

    command.__doc__ = doc
    return sandbox.command(name=verb)(command)


_DONE = {
    "partition": "link down (partitioned); `corral sandbox heal {node}` restores it",
    "heal": "link up",
    "stop": "stopped, every process on it killed; `corral sandbox up` starts it again",
}
_node_command("partition", "Cut NODE off the network (its link goes down, like a pulled cable).")
_node_command("heal", "Reconnect a partitioned NODE.")
_node_command("stop", "Kill everything on NODE, sshd included (a crashed machine).")


@sandbox.command()
@click.argument("node")
@click.option("--rate", required=True, metavar="RATE", help="New link rate both ways (e.g. 10mbit), or 'off'.")
@_instance_options
def slow(node: str, rate: str, name: str, state_dir: str | None) -> None:
    """Throttle NODE's link to RATE (`--rate off` removes the limit)."""
    _sandbox(name, state_dir).slow(node, rate)
    notice(f"{node}: link rate {rate}")


# ---------------------------------------------------------------------------
# rendering


def _print_json(document: str, data: dict) -> None:
    from corral.cli.common import emit_json

    emit_json(document, data, sort_keys=True)


def _render(st: SandboxStatus, *, next_steps: bool) -> None:
    con = console()
    name_flag = "" if st.name == DEFAULT_NAME else f" --name {st.name}"
    if not st.exists:
        con.print(f"sandbox {st.name}: not up (no state in {st.state_dir})")
        con.print(f"  start one: corral sandbox up 4 --with-keys{name_flag}")
        return
    healthy = sum(1 for n in st.nodes if n.ok)
    con.print(f"sandbox [bold]{st.name}[/]: {healthy}/{len(st.nodes)} nodes up on {st.subnet} "
              f"(head {st.head_address}), sshd port {st.ssh_port}")
    table = Table(box=None, pad_edge=False)
    for col in ("node", "address", "state", "link", "rate", "procs"):
        table.add_column(col)
    if st.fast_subnet:
        table.add_column("eth1 (fast)")
    for n in st.nodes:
        row = [n.name, n.address, _color(n.state, "running"), _color(n.link, "up"),
               format_rate(n.rate), str(n.processes)]
        if st.fast_subnet:
            row.append(n.fast_address or "")
        table.add_row(*row)
    con.print(table)
    con.print("files:")
    for label, key in (("cluster file", "cluster_file"), ("hostfile", "hostfile"),
                       ("ssh config", "ssh_config"), ("known_hosts", "known_hosts"),
                       ("head key", "identity_file"), ("slurm.conf", "slurm_conf")):
        if key in st.files:
            con.print(f"  {label:<13} {st.files[key]}")
    if st.password_auth:
        pw = st.test_password if st.test_password else "(the one given with --password)"
        con.print(f"password login: user {st.test_user}, password {pw}")
    if next_steps:
        first = st.nodes[0].name
        cfg = shlex.quote(st.files["ssh_config"])
        con.print("next:")
        if st.with_keys:
            con.print(f"  corral run --cluster {shlex.quote(st.files['cluster_file'])} examples/train_ddp.py")
            con.print(f"  ssh -F {cfg} {first} hostname")
        else:
            con.print("  no keys yet (a true first contact): set them up with `corral ssh`, "
                      "or start with --with-keys")
        if "slurm_conf" in st.files:
            con.print(f"  export SLURM_CONF={shlex.quote(st.files['slurm_conf'])}; sinfo; "
                      f"salloc -N{len(st.nodes)} corral run examples/train_ddp.py")
        con.print(f"  corral sandbox exec{name_flag} {first} -- ps ax")
        con.print(f"  corral sandbox down{name_flag}")


def _color(value: str, good: str) -> str:
    return f"[green]{value}[/]" if value == good else f"[red]{value}[/]"
