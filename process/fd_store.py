"""systemd's file descriptor store, without libsystemd: what a restart must not lose.

Storing (sd_pid_notify_with_fds): one datagram to $NOTIFY_SOCKET, "FDSTORE=1\\nFDNAME=<name>",
with the descriptors attached as SCM_RIGHTS. The service manager keeps a duplicate of each
(the process keeps its own) when the unit has `FileDescriptorStoreMax=` above zero; systemd
(v254+) then sets $FDSTORE to that maximum, which is how a process knows that storing is worth
doing (`store_enabled`). "FDSTOREREMOVE=1\\nFDNAME=<name>" drops every stored descriptor of that
name. With `FileDescriptorStorePreserve=yes` the store outlives a stop, not only a restart.

Receiving (sd_listen_fds_with_names): the next process of the unit starts with the stored
descriptors at 3, 4, ... (SD_LISTEN_FDS_START), $LISTEN_FDS their count, $LISTEN_PID its own
pid (variables inherited by anything else are not for it), $LISTEN_FDNAMES their names joined
by ":". `listened_fds` reads them once, marks the descriptors close-on-exec and unsets the
variables, as `sd_listen_fds(unset_environment=1)` does, so no child takes them for its own.
"""

import os
from collections.abc import MutableMapping

from pagedkv.process.notify import notify

# Set by systemd (v254+) to FileDescriptorStoreMax= when it is above zero.
FD_STORE_ENV = "FDSTORE"
# The socket activation variables of the receiving side.
LISTEN_FDS_ENV, LISTEN_PID_ENV, LISTEN_FDNAMES_ENV = "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"
# The first passed descriptor (SD_LISTEN_FDS_START).
LISTEN_FDS_START = 3
# systemd's limit on a descriptor's name (FDNAME_MAX).
FD_NAME_MAX = 255


def check_fd_name(name: str) -> str:
    """`name` if systemd accepts it as an FDNAME (1 to 255 printable ASCII characters, no ":",
    the separator of $LISTEN_FDNAMES); ValueError naming what is wrong otherwise."""
    if not 0 < len(name) <= FD_NAME_MAX:
        raise ValueError(f"a stored descriptor's name has 1 to {FD_NAME_MAX} characters, "
                         f"got {len(name)}")
    if any(not " " <= char <= "~" or char == ":" for char in name):
        raise ValueError(f"a stored descriptor's name is printable ASCII without ':', "
                         f"got {name!r}")
    return name


def store_enabled(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether the service manager keeps stored descriptors for this unit ($FDSTORE > 0)."""
    value = (os.environ if env is None else env).get(FD_STORE_ENV, "")
    return value.isdigit() and int(value) > 0


def store_fds(name: str, fds: list[int], env: MutableMapping[str, str] | None = None) -> bool:
    """Hand duplicates of `fds` to the service manager under `name`; True if sent."""
    return notify("FDSTORE=1", f"FDNAME={check_fd_name(name)}", env=env, fds=fds)


def remove_fds(name: str, env: MutableMapping[str, str] | None = None) -> bool:
    """Ask the service manager to close every descriptor it keeps under `name`; True if sent."""
    return notify("FDSTOREREMOVE=1", f"FDNAME={check_fd_name(name)}", env=env)


def listened_fds(env: MutableMapping[str, str] | None = None) -> dict[str, list[int]]:
    """The descriptors passed to this process by name (several may share one), taken once: the
    variables are unset and the descriptors made close-on-exec. {} when none were passed or
    $LISTEN_PID names another process; ValueError for malformed variables."""
    environ = os.environ if env is None else env
    count, pid = environ.pop(LISTEN_FDS_ENV, ""), environ.pop(LISTEN_PID_ENV, "")
    names_text = environ.pop(LISTEN_FDNAMES_ENV, None)
    if not count or not pid.isdigit() or int(pid) != os.getpid():
        return {}
    if not count.isdigit():
        raise ValueError(f"{LISTEN_FDS_ENV} is a count of descriptors, got {count!r}")
    fds = range(LISTEN_FDS_START, LISTEN_FDS_START + int(count))
    names = names_text.split(":") if names_text is not None else ["unknown"] * len(fds)
    if len(names) != len(fds):
        raise ValueError(f"{LISTEN_FDNAMES_ENV} names {len(names)} descriptors, "
                         f"{LISTEN_FDS_ENV} says {len(fds)}")
    passed: dict[str, list[int]] = {}
    for fd, name in zip(fds, names, strict=True):
        os.set_inheritable(fd, False)
        passed.setdefault(name, []).append(fd)
    return passed
