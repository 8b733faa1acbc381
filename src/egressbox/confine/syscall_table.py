"""The system calls a confined child may make, each with its reason (DESIGN section 7, "seccomp").

One table, read by confine/seccomp.py, which builds the filter from it:

- ALLOWED: the allow list. Measured: every call that ordinary tools made under ``strace -f``
  (``scripts/measure-syscalls``; the figures in benchmarks/syscalls-measured.json) is here, plus
  the siblings of a measured call that differ only in how they take their arguments (``preadv``
  beside ``pread64``), so that another libc or runtime does not fail where glibc passed.
  Calls in ARGUMENT_CHECKED are allowed only with the arguments seccomp.py's rules admit.
- FALLBACK: refused with ENOSYS, the answer of a kernel without the call, because callers then
  fall back to an older call the list allows (io_uring to read/write, clone3 to clone).
- REFUSED: refusals worth their own reason (EPERM). Every other call this table's kernel knows
  is refused with EPERM too; a call newer than the table (or no call at all) gets ENOSYS.

Names are the kernel's (x86_64 spelling where architectures differ); libseccomp resolves them
per architecture. NOT_ON_AARCH64 lists the names aarch64 lacks: that architecture has only the
``*at`` forms (``openat`` for ``open``, ``clone`` for ``fork``), which are listed as well, so
the filter there skips those names and allows the same operations.

The table matches the kernel's syscall tables of TABLE_KERNEL; libseccomp (measured with
LIBSECCOMP_VERSION) knows names up to Linux 6.7, so NEWER_NUMBERS gives the numbers of later
calls (one number on every architecture but alpha and mips since Linux 5.1).
"""

from __future__ import annotations

from types import MappingProxyType

TABLE_KERNEL = "6.17"  # the last kernel whose new system calls this table sorts (numbers to 469)
LIBSECCOMP_VERSION = "2.5.4"  # Debian 12's libseccomp2, whose resolver names calls up to 456
# What scripts/measure-syscalls found (benchmarks/syscalls-measured.json).
MEASURED = "160 distinct calls from 12 tools under strace -f on Linux 6.18 x86_64"

# Calls after Linux 6.7 (libseccomp 2.5.4 does not know their names): the unified numbers.
NEWER_NUMBERS = MappingProxyType(
    {
        "statmount": 457,
        "listmount": 458,
        "lsm_get_self_attr": 459,
        "lsm_set_self_attr": 460,
        "lsm_list_modules": 461,
        "mseal": 462,
        "setxattrat": 463,
        "getxattrat": 464,
        "listxattrat": 465,
        "removexattrat": 466,
        "open_tree_attr": 467,
        "file_getattr": 468,
        "file_setattr": 469,
    }
)

# Allowed, but only with the arguments the rules in confine/seccomp.py admit.
ARGUMENT_CHECKED = frozenset(
    {
        "socket",
        "socketpair",
        "sendto",
        "sendmsg",
        "sendmmsg",
        "setsockopt",
        "ioctl",
        "clone",
        "unshare",
        "personality",
    }
)

_FILES = {
    "read": "read a descriptor",
    "write": "write a descriptor",
    "readv": "scattered read",
    "writev": "gathered write",
    "pread64": "read at an offset",
    "pwrite64": "write at an offset",
    "preadv": "scattered read at an offset (sibling of pread64)",
    "pwritev": "gathered write at an offset (sibling of pwrite64)",
    "preadv2": "preadv with flags (sibling of pread64)",
    "pwritev2": "pwritev with flags (sibling of pwrite64)",
    "open": "open a file (x86_64; openat elsewhere)",
    "openat": "open a file relative to a directory",
    "openat2": "openat with resolve flags (sibling of openat)",
    "creat": "create a file (old form of open)",
    "close": "close a descriptor",
    "close_range": "close many descriptors (before exec)",
    "lseek": "move a file offset",
    "dup": "duplicate a descriptor",
    "dup2": "duplicate onto a number (x86_64; dup3 elsewhere)",
    "dup3": "duplicate onto a number with flags",
    "pipe": "make a pipe (x86_64; pipe2 elsewhere)",
    "pipe2": "make a pipe with flags",
    "fcntl": "descriptor flags and record locks",
    "flock": "whole-file locks (package managers, git)",
    "fsync": "flush a file",
    "fdatasync": "flush a file's data",
    "sync_file_range": "flush part of a file (sibling of fdatasync)",
    "syncfs": "flush a file system (sibling of fsync)",
    "sync": "flush all file systems (sibling of fsync)",
    "truncate": "set a file's size by name",
    "ftruncate": "set a file's size",
    "fallocate": "reserve file space",
    "fadvise64": "access pattern hints",
    "readahead": "prefetch a file (sibling of fadvise64)",
    "sendfile": "copy between descriptors in the kernel",
    "copy_file_range": "copy between files in the kernel",
    "splice": "move data through a pipe (sibling of sendfile)",
    "tee": "duplicate pipe data (sibling of splice)",
    "vmsplice": "map memory into a pipe (sibling of splice)",
    "stat": "file status by name (x86_64; newfstatat elsewhere)",
    "lstat": "file status of a link (x86_64)",
    "fstat": "file status of a descriptor",
    "newfstatat": "file status relative to a directory",
    "statx": "extended file status",
    "statfs": "file system status",
    "fstatfs": "file system status of a descriptor",
    "access": "check access by name (x86_64)",
    "faccessat": "check access relative to a directory",
    "faccessat2": "faccessat with flags",
    "getdents": "read a directory (x86_64, old form)",
    "getdents64": "read a directory",
    "getcwd": "current directory",
    "chdir": "change directory",
    "fchdir": "change directory by descriptor",
    "mkdir": "make a directory (x86_64)",
    "mkdirat": "make a directory relative to a directory",
    "rmdir": "remove a directory (x86_64)",
    "rename": "rename (x86_64)",
    "renameat": "rename relative to directories",
    "renameat2": "rename with flags (no-replace, exchange)",
    "link": "hard link (x86_64)",
    "linkat": "hard link relative to directories",
    "unlink": "remove a name (x86_64)",
    "unlinkat": "remove a name relative to a directory",
    "symlink": "symbolic link (x86_64)",
    "symlinkat": "symbolic link relative to a directory",
    "readlink": "read a link (x86_64)",
    "readlinkat": "read a link relative to a directory",
    "chmod": "file mode by name (x86_64)",
    "fchmod": "file mode by descriptor",
    "fchmodat": "file mode relative to a directory",
    "fchmodat2": "fchmodat with flags (glibc 2.39+ uses it for lchmod)",
    "chown": "file owner by name (x86_64)",
    "fchown": "file owner by descriptor",
    "lchown": "file owner of a link (x86_64)",
    "fchownat": "file owner relative to a directory",
    "umask": "file creation mask",
    "utime": "file times (x86_64, old form)",
    "utimes": "file times (x86_64, old form)",
    "futimesat": "file times relative to a directory (x86_64, old form)",
    "utimensat": "file times in nanoseconds",
    "mknod": "make a FIFO (device nodes need CAP_MKNOD, never held) (x86_64)",
    "mknodat": "make a FIFO relative to a directory",
    "getxattr": "read an extended attribute",
    "lgetxattr": "read a link's extended attribute",
    "fgetxattr": "read a descriptor's extended attribute",
    "getxattrat": "read an extended attribute relative to a directory (sibling of getxattr)",
    "listxattr": "list extended attributes",
    "llistxattr": "list a link's extended attributes",
    "flistxattr": "list a descriptor's extended attributes",
    "listxattrat": "list extended attributes relative to a directory (sibling of listxattr)",
    "setxattr": "set an extended attribute (cp -a, tar)",
    "lsetxattr": "set a link's extended attribute",
    "fsetxattr": "set a descriptor's extended attribute",
    "setxattrat": "set an extended attribute relative to a directory (sibling of setxattr)",
    "removexattr": "remove an extended attribute",
    "lremovexattr": "remove a link's extended attribute",
    "fremovexattr": "remove a descriptor's extended attribute",
    "removexattrat": "remove an extended attribute relative to a directory",
    "inotify_init": "file change watches (x86_64, old form)",
    "inotify_init1": "file change watches (watchers, dev servers)",
    "inotify_add_watch": "add a file watch",
    "inotify_rm_watch": "remove a file watch",
}

_MEMORY = {
    "brk": "grow the heap",
    "mmap": "map memory or a file",
    "munmap": "unmap memory",
    "mremap": "resize a mapping",
    "mprotect": "change a mapping's protection (JITs, the dynamic loader)",
    "madvise": "memory usage hints",
    "mincore": "which pages are resident",
    "msync": "flush a file mapping",
    "mlock": "lock pages (bounded by RLIMIT_MEMLOCK)",
    "mlock2": "lock pages with flags",
    "munlock": "unlock pages",
    "mlockall": "lock all pages (bounded by RLIMIT_MEMLOCK)",
    "munlockall": "unlock all pages",
    "memfd_create": "an anonymous file (JITs, Node, Chromium)",
    "membarrier": "memory barriers across threads (JITs, .NET, Go)",
    "pkey_alloc": "allocate a memory protection key (glibc probes it at start-up)",
    "pkey_free": "free a memory protection key",
    "pkey_mprotect": "mprotect with a protection key",
    "mseal": "seal the process's own mappings (only restricts itself)",
    "get_mempolicy": "NUMA policy of the process (JVM, numactl)",
    "set_mempolicy": "NUMA policy of the process",
    "mbind": "NUMA policy of a range",
}

_PROCESSES = {
    "clone": "threads and processes; refused with any CLONE_NEW* flag (rules)",
    "fork": "a process (x86_64; clone elsewhere)",
    "vfork": "a process sharing memory until exec (posix_spawn, make)",
    "execve": "run a program",
    "execveat": "run a program by descriptor",
    "exit": "end a thread",
    "exit_group": "end the process",
    "wait4": "wait for a child",
    "waitid": "wait for a child",
    "kill": "signal a process (only those in the child's PID namespace exist)",
    "tkill": "signal a thread (old form)",
    "tgkill": "signal a thread",
    "pidfd_open": "a descriptor for a child process",
    "pidfd_send_signal": "signal a process by descriptor",
    "getpid": "own process id",
    "getppid": "parent process id",
    "gettid": "own thread id",
    "getpgid": "process group of a process",
    "setpgid": "move into a process group (shells' job control)",
    "getpgrp": "own process group (x86_64)",
    "getsid": "session id",
    "setsid": "a new session (daemons, terminals)",
    "set_tid_address": "thread start-up (libc)",
    "set_robust_list": "thread start-up (libc)",
    "get_robust_list": "robust futex list",
    "rseq": "restartable sequences (glibc registers one per thread)",
    "futex": "thread synchronisation",
    "futex_waitv": "wait on several futexes (sibling of futex)",
    "futex_wake": "futex2 wake (sibling of futex)",
    "futex_wait": "futex2 wait (sibling of futex)",
    "futex_requeue": "futex2 requeue (sibling of futex)",
    "sched_yield": "yield the CPU",
    "sched_getaffinity": "CPUs the process may use (thread pool sizes)",
    "sched_setaffinity": "restrict the CPUs the process uses",
    "sched_getparam": "scheduling parameters",
    "sched_setparam": "scheduling parameters (real-time needs a capability)",
    "sched_getscheduler": "scheduling policy",
    "sched_setscheduler": "scheduling policy (real-time needs a capability)",
    "sched_getattr": "scheduling attributes",
    "sched_setattr": "scheduling attributes (real-time needs a capability)",
    "sched_get_priority_max": "priority range",
    "sched_get_priority_min": "priority range",
    "sched_rr_get_interval": "round-robin interval",
    "getpriority": "nice value",
    "setpriority": "lower the nice value (nice, make -l)",
    "ioprio_get": "I/O priority",
    "ioprio_set": "lower the I/O priority (ionice)",
    "getcpu": "the CPU a thread runs on",
    "prctl": "process attributes (names, no_new_privs, dumpable; only restricts itself)",
    "arch_prctl": "thread pointer set-up (x86_64)",
    "personality": "execution domain; only the default persona or a query (rules)",
    "capget": "read capabilities (none are held)",
    "capset": "drop capabilities (none can be raised)",
    "seccomp": "add a stricter filter (sandboxes inside the child; filters only add up)",
    "landlock_create_ruleset": "a nested Landlock domain (only restricts further)",
    "landlock_add_rule": "a nested Landlock domain (only restricts further)",
    "landlock_restrict_self": "a nested Landlock domain (only restricts further)",
    "unshare": "unshare files or fs state; refused with any CLONE_NEW* flag (rules)",
    "getrlimit": "resource limits (old form)",
    "setrlimit": "resource limits (old form)",
    "prlimit64": "resource limits (raising a hard limit needs a capability)",
    "getrusage": "resource usage",
    "times": "process times",
    "uname": "system name",
    "sysinfo": "memory and load figures",
    "getrandom": "random bytes",
}

_IDENTITY = {
    "getuid": "user id",
    "geteuid": "effective user id",
    "getgid": "group id",
    "getegid": "effective group id",
    "getresuid": "all user ids",
    "getresgid": "all group ids",
    "getgroups": "supplementary groups",
    "setuid": "change among the process's own ids (no capabilities to do more)",
    "setgid": "change among the process's own ids",
    "setreuid": "change among the process's own ids",
    "setregid": "change among the process's own ids",
    "setresuid": "change among the process's own ids (Chromium, ssh)",
    "setresgid": "change among the process's own ids",
    "setgroups": "supplementary groups (needs a capability to change)",
    "setfsuid": "file system id (a query with its own id)",
    "setfsgid": "file system id (a query with its own id)",
}

_SIGNALS_AND_TIME = {
    "rt_sigaction": "signal handlers",
    "rt_sigprocmask": "signal mask",
    "rt_sigreturn": "return from a signal handler",
    "rt_sigpending": "pending signals",
    "rt_sigtimedwait": "wait for a signal",
    "rt_sigsuspend": "wait for a signal with a mask",
    "rt_sigqueueinfo": "queue a signal with data",
    "rt_tgsigqueueinfo": "queue a signal to a thread with data",
    "sigaltstack": "signal stack (Go, Rust, Python's faulthandler)",
    "signalfd": "signals as a descriptor (old form)",
    "signalfd4": "signals as a descriptor",
    "pause": "wait for a signal (x86_64)",
    "alarm": "a timer signal (x86_64)",
    "restart_syscall": "resume a call after a stop signal",
    "clock_gettime": "read a clock",
    "clock_getres": "a clock's resolution",
    "clock_nanosleep": "sleep",
    "nanosleep": "sleep",
    "gettimeofday": "read the clock (old form)",
    "time": "read the clock (x86_64, old form)",
    "getitimer": "interval timers",
    "setitimer": "interval timers (profilers)",
    "timer_create": "POSIX timers (Go, Python's faulthandler)",
    "timer_settime": "POSIX timers",
    "timer_gettime": "POSIX timers",
    "timer_getoverrun": "POSIX timers",
    "timer_delete": "POSIX timers",
    "timerfd_create": "timers as descriptors (event loops)",
    "timerfd_settime": "timers as descriptors",
    "timerfd_gettime": "timers as descriptors",
}

_EVENTS_AND_IPC = {
    "poll": "wait on descriptors (x86_64)",
    "ppoll": "wait on descriptors",
    "select": "wait on descriptors (x86_64)",
    "pselect6": "wait on descriptors",
    "epoll_create": "event loop (x86_64, old form)",
    "epoll_create1": "event loop",
    "epoll_ctl": "event loop",
    "epoll_wait": "event loop (x86_64)",
    "epoll_pwait": "event loop",
    "epoll_pwait2": "event loop with a nanosecond timeout",
    "eventfd": "event counter (x86_64, old form)",
    "eventfd2": "event counter",
    "shmget": "System V shared memory (in the child's own IPC namespace)",
    "shmat": "System V shared memory",
    "shmdt": "System V shared memory",
    "shmctl": "System V shared memory",
    "semget": "System V semaphores (in the child's own IPC namespace)",
    "semop": "System V semaphores",
    "semtimedop": "System V semaphores",
    "semctl": "System V semaphores",
    "msgget": "System V message queues (in the child's own IPC namespace)",
    "msgsnd": "System V message queues",
    "msgrcv": "System V message queues",
    "msgctl": "System V message queues",
}

_SOCKETS = {
    "socket": "unix, and TCP over IPv4/IPv6 (UDP only when captured); the rest refused (rules)",
    "socketpair": "unix socket pairs only (rules)",
    "connect": "connect (Landlock admits only the proxy's ports; the namespace has no route)",
    "bind": "bind (Landlock rules TCP ports; unix sockets under granted roots)",
    "listen": "listen (test servers on the private loopback)",
    "accept": "accept (old form)",
    "accept4": "accept",
    "getsockname": "local address",
    "getpeername": "peer address",
    "sendto": "send; MSG_FASTOPEN refused (rules)",
    "recvfrom": "receive",
    "sendmsg": "send with control data; MSG_FASTOPEN refused (rules)",
    "recvmsg": "receive with control data",
    "sendmmsg": "send several; MSG_FASTOPEN refused (rules)",
    "recvmmsg": "receive several",
    "shutdown": "shut down a direction",
    "setsockopt": "socket options; TCP_FASTOPEN_CONNECT refused (rules)",
    "getsockopt": "socket options",
    "ioctl": "device and terminal control; TIOCSTI and TIOCLINUX refused (rules)",
}

ALLOWED = MappingProxyType(
    {
        **_FILES,
        **_MEMORY,
        **_PROCESSES,
        **_IDENTITY,
        **_SIGNALS_AND_TIME,
        **_EVENTS_AND_IPC,
        **_SOCKETS,
    }
)

FALLBACK = MappingProxyType(
    {
        "io_uring_setup": "io_uring acts out of seccomp's sight; libuv and Tokio fall back",
        "io_uring_enter": "io_uring (see io_uring_setup)",
        "io_uring_register": "io_uring (see io_uring_setup)",
        "clone3": "its flags are in memory, out of seccomp's sight; glibc falls back to clone",
        "io_setup": "Linux AIO: kernels without CONFIG_AIO answer ENOSYS and callers use threads",
        "io_destroy": "Linux AIO (see io_setup)",
        "io_submit": "Linux AIO (see io_setup)",
        "io_cancel": "Linux AIO (see io_setup)",
        "io_getevents": "Linux AIO (see io_setup)",
        "io_pgetevents": "Linux AIO (see io_setup)",
        "statmount": "mount details: callers fall back to /proc/self/mountinfo",
        "listmount": "mount listing: callers fall back to /proc/self/mountinfo",
        "lsm_get_self_attr": "LSM attributes: callers fall back to /proc/self/attr",
        "lsm_set_self_attr": "LSM attributes: callers fall back to /proc/self/attr",
        "lsm_list_modules": "LSM list: callers fall back to /sys/kernel/security/lsm",
        "file_getattr": "inode flags: callers fall back to the FS_IOC_FSGETXATTR ioctl",
        "file_setattr": "inode flags: callers fall back to the FS_IOC_FSSETXATTR ioctl",
        "map_shadow_stack": "glibc runs without a shadow stack when the kernel lacks it",
        "cachestat": "page cache figures: callers fall back to mincore",
    }
)

# Refusals with a reason of their own (the old deny list's groups). Any other call the kernel
# table knows and ALLOWED does not list is refused with EPERM as well.
REFUSED = MappingProxyType(
    {
        "ptrace": "reads and writes other processes of the same user (the launcher, the proxy)",
        "process_vm_readv": "reads another process's memory",
        "process_vm_writev": "writes another process's memory",
        "process_madvise": "acts on another process's memory",
        "process_mrelease": "acts on another process's memory",
        "pidfd_getfd": "copies a descriptor out of another process",
        "kcmp": "probes another process's descriptors and memory layout",
        "bpf": "the BPF verifier, and socket filters that could rewrite traffic",
        "perf_event_open": "side channels and a long record of kernel bugs",
        "userfaultfd": "stalls kernel copies at will: the classic race-widening tool",
        "keyctl": "keyrings are shared per user: another session's tokens live there",
        "add_key": "keyrings (see keyctl)",
        "request_key": "keyrings (see keyctl)",
        "lookup_dcookie": "leaks kernel path names",
        "iopl": "raw I/O ports",
        "ioperm": "raw I/O ports",
        "modify_ldt": "16-bit segments: old kernel bugs, no modern tool needs them",
        "mount": "the mount namespace hides the host's sockets and /tmp: no changing it",
        "umount2": "mounts (see mount)",
        "pivot_root": "mounts (see mount)",
        "move_mount": "mounts (see mount)",
        "open_tree": "mounts (see mount)",
        "open_tree_attr": "mounts (see mount)",
        "fsopen": "mounts (see mount)",
        "fsconfig": "mounts (see mount)",
        "fsmount": "mounts (see mount)",
        "fspick": "mounts (see mount)",
        "mount_setattr": "mounts (see mount)",
        "chroot": "a changed root (needs a capability; refused if one leaks)",
        "setns": "joining another namespace (/proc/1/ns/net is the host's network)",
        "open_by_handle_at": "opens files by handle around the mount view (container escape)",
        "name_to_handle_at": "file handles (see open_by_handle_at)",
        "fanotify_init": "whole-file-system watches",
        "fanotify_mark": "whole-file-system watches",
        "init_module": "kernel modules",
        "finit_module": "kernel modules",
        "delete_module": "kernel modules",
        "kexec_load": "booting another kernel",
        "kexec_file_load": "booting another kernel",
        "swapon": "swap",
        "swapoff": "swap",
        "reboot": "reboot",
        "acct": "process accounting",
        "quotactl": "disk quotas",
        "quotactl_fd": "disk quotas",
        "syslog": "the kernel log",
        "settimeofday": "setting the system clock",
        "clock_settime": "setting the system clock",
        "adjtimex": "tuning the system clock",
        "clock_adjtime": "tuning the system clock",
        "sethostname": "the host name",
        "setdomainname": "the domain name",
        "memfd_secret": "memory hidden from the kernel (no tool measured needs it)",
        "migrate_pages": "moves another process's pages",
        "move_pages": "moves another process's pages",
        "mq_open": "POSIX message queues (no tool measured needs them)",
        "vhangup": "hangs up the terminal",
        "uselib": "old library loading",
        "ustat": "old file system status",
        "sysfs": "old file system type listing",
    }
)

# Names the generic syscall table (aarch64, riscv64) lacks: the filter skips them there, and
# the *at, 2 and pselect/ppoll forms listed beside them do the same work.
NOT_ON_AARCH64 = frozenset(
    {
        "open", "creat", "dup2", "pipe", "stat", "lstat", "access", "getdents", "mkdir", "rmdir",
        "rename", "link", "unlink", "symlink", "readlink", "chmod", "chown", "lchown", "utime",
        "utimes", "futimesat", "mknod", "inotify_init", "fork", "vfork", "getpgrp", "arch_prctl",
        "pause", "alarm", "time", "poll", "select", "epoll_create", "epoll_wait", "eventfd",
        "signalfd", "iopl", "ioperm", "modify_ldt", "uselib", "ustat", "sysfs",
    }
)  # fmt: skip


def summary(allowed: int = len(ALLOWED)) -> str:
    """The filter in one line, for reports (``allowed``: how many calls this architecture has)."""
    return (
        f"allow list of {allowed} system calls (measured: {MEASURED}); other calls the kernel "
        f"table knows get EPERM, newer or unknown ones ENOSYS"
    )


def report_row() -> str:
    """The run report's seccomp detail: the list's size and the measurement behind it."""
    return f"allow list of {len(ALLOWED)} system calls (measured: {MEASURED})"
