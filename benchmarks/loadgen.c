/*
 * Load generator for benchmarks/proxy.py: one process, epoll, non-blocking
 * sockets, optionally several threads (each its own epoll and its own share
 * of the clients). Built by benchmarks/setup.sh into benchmarks/build/loadgen.
 *
 *   loadgen tunnel     --via direct|connect|socks5 [--proxy H:P] --target H:P
 *                      [--concurrency C] [--threads T] [--warmup S] [--duration S]
 *                      [--count N] [--payload B] [--socks-atyp domain|ipv4]
 *   loadgen http       --via direct|proxy [--proxy H:P] --target H:P
 *                      [--requests-per-connection K] (1: one request per
 *                      connection; 0: keep-alive, unlimited) ...
 *   loadgen throughput --via direct|connect|socks5 ... --bytes N [--chunk B]
 *   loadgen idle       --via connect|socks5 ... --count N [--concurrency C]
 *                      [--hold S]
 *
 * tunnel: each of C clients loops: connect, handshake (CONNECT host:port, or
 * SOCKS5 with the host as a domain name unless --socks-atyp ipv4), read the
 * 200 / success reply, send --payload bytes (64) to the echo origin through
 * the tunnel, read them back, close. Latency: connect() to the echo's last
 * byte.
 *
 * http: each client sends GET (absolute-form through a proxy, origin-form
 * direct), reads the response head and Content-Length body, and either
 * closes (one request per connection) or sends the next request on the same
 * connection. A kept-alive connection the server closes (without saying so)
 * is reopened and counted in "reconnects", not as an error. Latency: the
 * request's write (for a connection's first request: connect()) to the
 * body's last byte.
 *
 * throughput: one blocking tunnel to the bulk sink of benchmarks/origin.c:
 * a 9-byte header ('U' and a big-endian u64 N), N bytes in --chunk writes,
 * timed to the sink's one-byte acknowledgement.
 *
 * idle: opens --count tunnels (at most --concurrency handshakes at once),
 * checks each with an echo, prints {"event": "ready", ...}, holds them until
 * a line arrives on stdin or --hold seconds pass, closes them, prints
 * {"event": "closed"}.
 *
 * tunnel and http run --warmup seconds unrecorded, then record for
 * --duration seconds or until --count operations are recorded, whichever
 * comes first, and print one JSON object: ops, per_s, errors, error_kinds,
 * latency percentiles (us), the generator's own CPU, and, for every
 * --cpu NAME=PID[,PID...], utime and stime of those processes (all their
 * threads) over exactly the recorded window, plus the machine's busy cores
 * from /proc/stat over the same window. Every loop ends by count or time;
 * every operation has a --timeout (10 s). Only the given addresses are
 * dialled (benchmarks/proxy.py passes 127.0.0.1 only).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define BUFSZ 4096
#define MAX_EVENTS 256
#define MAX_THREADS 64
#define MAX_GROUPS 8
#define MAX_PIDS 64
#define BACKOFF_NS 10000000ull /* after an error, a client waits 10 ms before retrying */
#define SCAN_NS 5000000ull     /* timeouts and back-offs are checked every 5 ms */

enum mode { M_TUNNEL, M_HTTP, M_THROUGHPUT, M_IDLE };
enum via { V_DIRECT, V_CONNECT, V_SOCKS5, V_PROXY };
enum state { S_OFF, S_BACKOFF, S_HEAD, S_METHOD, S_REPLY, S_ECHO, S_RESP, S_HELD, S_DONE };
enum kind { K_EOF, K_TIMEOUT, K_BAD_REPLY, K_TOO_LONG, K_ERRNO0 };
#define NKINDS (K_ERRNO0 + 200)

struct config {
    enum mode mode;
    enum via via;
    struct sockaddr_in dial;
    char target_host[256];
    int target_port;
    int concurrency, threads;
    double warmup, duration, timeout, hold;
    uint64_t count;
    int payload;
    int socks_domain;
    int requests_per_conn;
    uint64_t bytes;
    size_t chunk;
};

struct group {
    char name[32];
    int pids[MAX_PIDS];
    int npids;
};

struct client {
    int fd;
    enum state state;
    const char *out;
    size_t outlen, outoff;
    uint64_t started, req_started, deadline, retry_at;
    size_t have;
    int reqs;
    unsigned gen; /* bumped per connection: a reused fd number is another connection */
    char buf[BUFSZ];
};

struct thread {
    pthread_t tid;
    int epfd;
    struct client *clients;
    int nclients;
    uint64_t *lat;
    size_t nlat, caplat;
    uint64_t kinds[NKINDS];
    uint64_t reconnects;
};

static struct config cfg;
static struct group groups[MAX_GROUPS];
static int ngroups;
static char connect_req[600], socks_req[300], http_req[800];
static size_t connect_req_len, socks_req_len, http_req_len;
static char payload[BUFSZ];
static const char socks_greeting[] = "\x05\x01\x00";
static atomic_int window_open, stop_flag;
static atomic_uint_fast64_t recorded;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

__attribute__((noreturn)) static void die(const char *what) {
    fprintf(stderr, "loadgen: %s: %s\n", what, strerror(errno));
    exit(1);
}

__attribute__((noreturn)) static void usage(const char *why) {
    fprintf(stderr, "loadgen: %s (see the comment at the top of benchmarks/loadgen.c)\n", why);
    exit(2);
}

/* --- CPU of other processes, the machine, and this one ------------------------------- */

struct cpu_mark {
    double group_user[MAX_GROUPS], group_sys[MAX_GROUPS];
    double self_user, self_sys, busy;
    uint64_t at;
};

static void proc_times(int pid, double *user, double *sys) {
    char path[64], text[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return;
    text[n] = 0;
    char *p = strrchr(text, ')');
    if (!p)
        return;
    /* After ") ": state(3) ppid(4) ... utime(14) stime(15). */
    unsigned long long ut = 0, st = 0;
    int field = 2;
    for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " ")) {
        field++;
        if (field == 14)
            ut = strtoull(tok, NULL, 10);
        else if (field == 15) {
            st = strtoull(tok, NULL, 10);
            break;
        }
    }
    double tck = (double)sysconf(_SC_CLK_TCK);
    *user += (double)ut / tck;
    *sys += (double)st / tck;
}

static double machine_busy(void) {
    FILE *f = fopen("/proc/stat", "re");
    if (!f)
        return 0;
    unsigned long long v[8] = {0};
    int got = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                     &v[4], &v[5], &v[6]);
    fclose(f);
    if (got < 7)
        return 0;
    /* user nice system (idle iowait) irq softirq */
    return (double)(v[0] + v[1] + v[2] + v[5] + v[6]) / (double)sysconf(_SC_CLK_TCK);
}

static void mark(struct cpu_mark *m) {
    for (int g = 0; g < ngroups; g++) {
        m->group_user[g] = m->group_sys[g] = 0;
        for (int i = 0; i < groups[g].npids; i++)
            proc_times(groups[g].pids[i], &m->group_user[g], &m->group_sys[g]);
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    m->self_user = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6;
    m->self_sys = (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    m->busy = machine_busy();
    m->at = now_ns();
}

static void print_cpu(const struct cpu_mark *a, const struct cpu_mark *b) {
    double secs = (double)(b->at - a->at) / 1e9;
    double user = b->self_user - a->self_user, sys = b->self_sys - a->self_sys;
    printf("\"generator_cpu_s\": %.4f, \"generator_utime_s\": %.4f, \"generator_stime_s\": %.4f, "
           "\"busy_cores\": %.3f, \"cpu\": {",
           user + sys, user, sys, secs > 0 ? (b->busy - a->busy) / secs : 0.0);
    for (int g = 0; g < ngroups; g++)
        printf("%s\"%s\": {\"utime_s\": %.3f, \"stime_s\": %.3f}", g ? ", " : "", groups[g].name,
               b->group_user[g] - a->group_user[g], b->group_sys[g] - a->group_sys[g]);
    printf("}");
}

/* --- requests ----------------------------------------------------------------------- */

static void build_requests(void) {
    char authority[300];
    snprintf(authority, sizeof authority, "%s:%d", cfg.target_host, cfg.target_port);
    connect_req_len = (size_t)snprintf(connect_req, sizeof connect_req,
                                       "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", authority,
                                       authority);
    unsigned char *s = (unsigned char *)socks_req;
    s[0] = 5, s[1] = 1, s[2] = 0;
    size_t n;
    if (cfg.socks_domain) {
        size_t len = strlen(cfg.target_host);
        s[3] = 3, s[4] = (unsigned char)len;
        memcpy(s + 5, cfg.target_host, len);
        n = 5 + len;
    } else {
        struct in_addr a;
        if (inet_pton(AF_INET, cfg.target_host, &a) != 1)
            usage("--socks-atyp ipv4 needs an IPv4 target");
        s[3] = 1;
        memcpy(s + 4, &a, 4);
        n = 8;
    }
    s[n] = (unsigned char)(cfg.target_port >> 8), s[n + 1] = (unsigned char)cfg.target_port;
    socks_req_len = n + 2;
    if (cfg.via == V_PROXY)
        http_req_len = (size_t)snprintf(http_req, sizeof http_req,
                                        "GET http://%s/ HTTP/1.1\r\nHost: %s\r\n\r\n", authority,
                                        authority);
    else
        http_req_len = (size_t)snprintf(http_req, sizeof http_req,
                                        "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", authority);
    memset(payload, 'x', sizeof payload);
}

/* --- the client state machine --------------------------------------------------------- */

static void record(struct thread *t, uint64_t since, uint64_t done) {
    if (!atomic_load_explicit(&window_open, memory_order_relaxed) ||
        atomic_load_explicit(&stop_flag, memory_order_relaxed))
        return;
    if (t->nlat == t->caplat) {
        t->caplat = t->caplat ? t->caplat * 2 : 65536;
        t->lat = realloc(t->lat, t->caplat * sizeof *t->lat);
        if (!t->lat)
            die("realloc");
    }
    t->lat[t->nlat++] = done - since;
    atomic_fetch_add_explicit(&recorded, 1, memory_order_relaxed);
}

static void start_op(struct thread *t, struct client *c, uint64_t now);

static void drop(struct client *c) {
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
}

static void fail(struct thread *t, struct client *c, int kind, uint64_t now) {
    t->kinds[kind < NKINDS ? kind : K_ERRNO0]++;
    drop(c);
    if (cfg.mode == M_IDLE) {
        c->state = S_DONE;
        return;
    }
    c->state = S_BACKOFF;
    c->retry_at = now + BACKOFF_NS;
}

static int fail_errno(int err) { return K_ERRNO0 + (err > 0 && err < 200 ? err : 0); }

/* Writes what is pending; 0: all written, 1: the rest waits for EPOLLOUT, -1: failed. */
static int flush(struct thread *t, struct client *c, uint64_t now) {
    while (c->outoff < c->outlen) {
        ssize_t n = write(c->fd, c->out + c->outoff, c->outlen - c->outoff);
        if (n > 0) {
            c->outoff += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EAGAIN)
            return 1;
        fail(t, c, fail_errno(n < 0 ? errno : EPIPE), now);
        return -1;
    }
    return 0;
}

/* Queues `data` and writes it; arms EPOLLOUT only if the socket could not take it. */
static int send_out(struct thread *t, struct client *c, const char *data, size_t len,
                    uint64_t now) {
    c->out = data, c->outlen = len, c->outoff = 0;
    int r = flush(t, c, now);
    if (r == 1) {
        struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, .data.ptr = c};
        if (epoll_ctl(t->epfd, EPOLL_CTL_MOD, c->fd, &ev) < 0) {
            fail(t, c, fail_errno(errno), now);
            return -1;
        }
    }
    return r < 0 ? -1 : 0;
}

static void consume(struct client *c, size_t n) {
    memmove(c->buf, c->buf + n, c->have - n);
    c->have -= n;
}

static void *find_head_end(struct client *c) { return memmem(c->buf, c->have, "\r\n\r\n", 4); }

static void op_done(struct thread *t, struct client *c, uint64_t since, uint64_t now) {
    record(t, since, now);
    if (cfg.mode == M_IDLE) {
        c->state = S_HELD;
        c->have = 0;
        return;
    }
    drop(c);
    c->state = S_OFF;
    if (!atomic_load_explicit(&stop_flag, memory_order_relaxed))
        start_op(t, c, now);
}

/* The value of header `name` (with its colon) in the head, or NULL. */
static const char *header(const char *head, size_t len, const char *name) {
    size_t nl = strlen(name);
    for (const char *p = head; p + nl < head + len;) {
        const char *eol = memmem(p, (size_t)(head + len - p), "\r\n", 2);
        if (!eol)
            break;
        p = eol + 2;
        if ((size_t)(head + len - p) > nl && strncasecmp(p, name, nl) == 0)
            return p + nl;
    }
    return NULL;
}

static void http_response(struct thread *t, struct client *c, uint64_t now) {
    char *end = find_head_end(c);
    if (!end) {
        if (c->have == BUFSZ)
            fail(t, c, K_TOO_LONG, now);
        return;
    }
    size_t head = (size_t)(end - c->buf) + 4;
    if (head < 12 || memcmp(c->buf, "HTTP/1.", 7) != 0 || memcmp(c->buf + 8, " 200", 4) != 0) {
        fail(t, c, K_BAD_REPLY, now);
        return;
    }
    const char *cl = header(c->buf, head, "content-length:");
    if (!cl) {
        fail(t, c, K_BAD_REPLY, now);
        return;
    }
    size_t body = (size_t)strtoul(cl, NULL, 10);
    if (head + body > BUFSZ) {
        fail(t, c, K_TOO_LONG, now);
        return;
    }
    if (c->have < head + body)
        return;
    if (c->have > head + body) { /* nothing was pipelined: extra bytes are a framing error */
        fail(t, c, K_BAD_REPLY, now);
        return;
    }
    const char *conn = header(c->buf, head, "connection:");
    int closing = (conn && strncasecmp(conn + strspn(conn, " "), "close", 5) == 0) ||
                  c->buf[7] == '0';
    c->reqs++;
    if (cfg.requests_per_conn > 0 && c->reqs >= cfg.requests_per_conn)
        closing = 1;
    uint64_t since = c->reqs == 1 ? c->started : c->req_started;
    if (closing) {
        op_done(t, c, since, now);
        return;
    }
    record(t, since, now);
    if (atomic_load_explicit(&stop_flag, memory_order_relaxed))
        return;
    c->have = 0;
    c->req_started = now;
    c->deadline = now + (uint64_t)(cfg.timeout * 1e9);
    send_out(t, c, http_req, http_req_len, now);
}

/* Advances the state machine over the bytes in c->buf. */
static void process(struct thread *t, struct client *c, uint64_t now) {
    if (c->state == S_HEAD) {
        char *end = find_head_end(c);
        if (!end) {
            if (c->have == BUFSZ)
                fail(t, c, K_TOO_LONG, now);
            return;
        }
        if (c->have < 12 || memcmp(c->buf, "HTTP/1.", 7) != 0 ||
            memcmp(c->buf + 8, " 200", 4) != 0) {
            fail(t, c, K_BAD_REPLY, now);
            return;
        }
        consume(c, (size_t)(end - c->buf) + 4);
        c->state = S_ECHO;
        if (send_out(t, c, payload, (size_t)cfg.payload, now) < 0)
            return;
    } else if (c->state == S_METHOD) {
        if (c->have < 2)
            return;
        if (c->buf[0] != 5 || c->buf[1] != 0) {
            fail(t, c, K_BAD_REPLY, now);
            return;
        }
        consume(c, 2);
        c->state = S_REPLY;
        if (send_out(t, c, socks_req, socks_req_len, now) < 0)
            return;
    }
    if (c->state == S_REPLY) {
        if (c->have < 5)
            return;
        unsigned char atyp = (unsigned char)c->buf[3];
        size_t size = atyp == 1 ? 10 : atyp == 4 ? 22 : atyp == 3 ? 7 + (unsigned char)c->buf[4] : 0;
        if (c->buf[0] != 5 || c->buf[1] != 0 || size == 0) {
            fail(t, c, K_BAD_REPLY, now);
            return;
        }
        if (c->have < size)
            return;
        consume(c, size);
        c->state = S_ECHO;
        if (send_out(t, c, payload, (size_t)cfg.payload, now) < 0)
            return;
    }
    if (c->state == S_ECHO) {
        if (c->have >= (size_t)cfg.payload)
            op_done(t, c, c->started, now);
    } else if (c->state == S_RESP) {
        http_response(t, c, now);
    } else if (c->state == S_HELD) {
        c->have = 0; /* nothing is expected on a held tunnel */
    }
}

static void on_eof(struct thread *t, struct client *c, int kind, uint64_t now) {
    if (c->state == S_RESP && c->have == 0 && c->reqs > 0) {
        /* The server closed a kept-alive connection between requests: reopen. */
        t->reconnects++;
        drop(c);
        c->state = S_OFF;
        start_op(t, c, now);
        return;
    }
    fail(t, c, kind, now);
}

static void on_event(struct thread *t, struct client *c, uint32_t events, uint64_t now) {
    if ((events & EPOLLOUT) && c->outoff < c->outlen) {
        if (flush(t, c, now) != 0)
            return;
    }
    if (!(events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
        return;
    int closed = events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR);
    while (c->fd >= 0) {
        size_t space = BUFSZ - c->have;
        if (space == 0) {
            fail(t, c, K_TOO_LONG, now);
            return;
        }
        ssize_t n = read(c->fd, c->buf + c->have, space);
        if (n > 0) {
            c->have += (size_t)n;
            unsigned gen = c->gen;
            process(t, c, now);
            /* Read again only if more may be queued: a full buffer, or a FIN behind the data
             * (edge-triggered: new data raises a new event). */
            if (c->fd < 0 || c->gen != gen || ((size_t)n < space && !closed))
                return;
            continue;
        }
        if (n == 0) {
            on_eof(t, c, K_EOF, now);
            return;
        }
        if (errno == EAGAIN)
            return;
        on_eof(t, c, fail_errno(errno), now);
        return;
    }
}

static void start_op(struct thread *t, struct client *c, uint64_t now) {
    c->have = 0;
    c->reqs = 0;
    c->gen++;
    c->started = c->req_started = now;
    c->deadline = now + (uint64_t)(cfg.timeout * 1e9);
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0) {
        fail(t, c, fail_errno(errno), now);
        return;
    }
    if (connect(c->fd, (struct sockaddr *)&cfg.dial, sizeof cfg.dial) < 0 && errno != EINPROGRESS) {
        fail(t, c, fail_errno(errno), now);
        return;
    }
    const char *data;
    size_t len;
    if (cfg.mode == M_HTTP) {
        c->state = S_RESP, data = http_req, len = http_req_len;
    } else if (cfg.via == V_CONNECT) {
        c->state = S_HEAD, data = connect_req, len = connect_req_len;
    } else if (cfg.via == V_SOCKS5) {
        c->state = S_METHOD, data = socks_greeting, len = 3;
    } else {
        c->state = S_ECHO, data = payload, len = (size_t)cfg.payload;
    }
    /* Write at once: on loopback the connection is usually established by now, so the
     * usual path is socket, connect, write, epoll_ctl (one), read, close. */
    c->out = data, c->outlen = len, c->outoff = 0;
    int r = flush(t, c, now);
    if (r < 0)
        return;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.ptr = c};
    if (r == 1)
        ev.events |= EPOLLOUT;
    if (epoll_ctl(t->epfd, EPOLL_CTL_ADD, c->fd, &ev) < 0)
        fail(t, c, fail_errno(errno), now);
}

static void scan(struct thread *t, uint64_t now) {
    for (int i = 0; i < t->nclients; i++) {
        struct client *c = &t->clients[i];
        if (c->state == S_BACKOFF) {
            if (now >= c->retry_at && !atomic_load_explicit(&stop_flag, memory_order_relaxed))
                start_op(t, c, now);
        } else if (c->fd >= 0 && c->state != S_HELD && now >= c->deadline) {
            fail(t, c, K_TIMEOUT, now);
        }
    }
}

static void *run_thread(void *arg) {
    struct thread *t = arg;
    struct epoll_event evs[MAX_EVENTS];
    uint64_t now = now_ns();
    for (int i = 0; i < t->nclients; i++)
        start_op(t, &t->clients[i], now);
    uint64_t next_scan = now + SCAN_NS;
    while (!atomic_load_explicit(&stop_flag, memory_order_relaxed)) {
        int n = epoll_wait(t->epfd, evs, MAX_EVENTS, 5);
        now = now_ns();
        for (int i = 0; i < n; i++)
            on_event(t, evs[i].data.ptr, evs[i].events, now);
        if (now >= next_scan) {
            scan(t, now);
            next_scan = now + SCAN_NS;
        }
    }
    for (int i = 0; i < t->nclients; i++)
        drop(&t->clients[i]);
    return NULL;
}

/* --- reporting ------------------------------------------------------------------------ */

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double pct(const uint64_t *v, size_t n, double q) {
    if (!n)
        return 0;
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return (double)v[i < n ? i : n - 1] / 1e3;
}

static const char *kind_name(int k, char *tmp, size_t len) {
    switch (k) {
    case K_EOF: return "eof";
    case K_TIMEOUT: return "timeout";
    case K_BAD_REPLY: return "bad_reply";
    case K_TOO_LONG: return "too_long";
    default: {
        const char *name = strerrorname_np(k - K_ERRNO0);
        snprintf(tmp, len, "%s", name ? name : "errno");
        return tmp;
    }
    }
}

static void print_errors(uint64_t *kinds) {
    uint64_t total = 0;
    for (int k = 0; k < NKINDS; k++)
        total += kinds[k];
    printf("\"errors\": %llu, \"error_kinds\": {", (unsigned long long)total);
    int first = 1;
    char tmp[64];
    for (int k = 0; k < NKINDS; k++)
        if (kinds[k]) {
            printf("%s\"%s\": %llu", first ? "" : ", ", kind_name(k, tmp, sizeof tmp),
                   (unsigned long long)kinds[k]);
            first = 0;
        }
    printf("}");
}

static const char *mode_name(void) {
    static const char *names[] = {"tunnel", "http", "throughput", "idle"};
    return names[cfg.mode];
}

static const char *via_name(void) {
    static const char *names[] = {"direct", "connect", "socks5", "proxy"};
    return names[cfg.via];
}

static void sleep_until(uint64_t at) {
    struct timespec ts = {.tv_sec = (time_t)(at / 1000000000ull), .tv_nsec = (long)(at % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static struct thread *new_threads(int nthreads, int nclients) {
    struct thread *ts = calloc((size_t)nthreads, sizeof *ts);
    struct client *cs = calloc((size_t)nclients, sizeof *cs);
    if (!ts || !cs)
        die("calloc");
    for (int i = 0; i < nclients; i++)
        cs[i].fd = -1;
    int at = 0;
    for (int i = 0; i < nthreads; i++) {
        ts[i].epfd = epoll_create1(EPOLL_CLOEXEC);
        if (ts[i].epfd < 0)
            die("epoll_create1");
        ts[i].clients = cs + at;
        ts[i].nclients = nclients / nthreads + (i < nclients % nthreads);
        at += ts[i].nclients;
    }
    return ts;
}

static int run_load(void) {
    int nt = cfg.threads < cfg.concurrency ? cfg.threads : cfg.concurrency;
    struct thread *ts = new_threads(nt, cfg.concurrency);
    uint64_t t0 = now_ns();
    for (int i = 0; i < nt; i++)
        if (pthread_create(&ts[i].tid, NULL, run_thread, &ts[i]) != 0)
            die("pthread_create");
    struct cpu_mark a, b;
    sleep_until(t0 + (uint64_t)(cfg.warmup * 1e9));
    mark(&a);
    atomic_store(&window_open, 1);
    uint64_t end = a.at + (uint64_t)(cfg.duration * 1e9);
    for (;;) {
        uint64_t now = now_ns();
        if (now >= end || (cfg.count && atomic_load(&recorded) >= cfg.count))
            break;
        uint64_t step = now + 1000000ull;
        sleep_until(step < end ? step : end);
    }
    mark(&b);
    atomic_store(&stop_flag, 1);
    for (int i = 0; i < nt; i++)
        pthread_join(ts[i].tid, NULL);

    size_t n = 0;
    uint64_t kinds[NKINDS] = {0}, reconnects = 0;
    for (int i = 0; i < nt; i++) {
        n += ts[i].nlat;
        reconnects += ts[i].reconnects;
        for (int k = 0; k < NKINDS; k++)
            kinds[k] += ts[i].kinds[k];
    }
    uint64_t *all = malloc((n ? n : 1) * sizeof *all);
    if (!all)
        die("malloc");
    size_t at = 0;
    for (int i = 0; i < nt; i++) {
        if (ts[i].nlat)
            memcpy(all + at, ts[i].lat, ts[i].nlat * sizeof *all);
        at += ts[i].nlat;
    }
    qsort(all, n, sizeof *all, cmp_u64);
    double secs = (double)(b.at - a.at) / 1e9;
    printf("{\"mode\": \"%s\", \"via\": \"%s\", \"concurrency\": %d, \"threads\": %d, "
           "\"ops\": %zu, \"elapsed\": %.4f, \"per_s\": %.1f, \"reconnects\": %llu, ",
           mode_name(), via_name(), cfg.concurrency, nt, n, secs, secs > 0 ? (double)n / secs : 0,
           (unsigned long long)reconnects);
    printf("\"p50_us\": %.1f, \"p90_us\": %.1f, \"p99_us\": %.1f, \"p999_us\": %.1f, "
           "\"max_us\": %.1f, ",
           pct(all, n, 0.5), pct(all, n, 0.9), pct(all, n, 0.99), pct(all, n, 0.999),
           pct(all, n, 1.0));
    print_errors(kinds);
    printf(", ");
    print_cpu(&a, &b);
    printf("}\n");
    fflush(stdout);
    return 0;
}

/* --- idle tunnels ----------------------------------------------------------------------- */

static int run_idle(void) {
    struct thread *t = new_threads(1, (int)cfg.count);
    int total = (int)cfg.count, started = 0, inflight = cfg.concurrency;
    uint64_t t0 = now_ns(), now = t0;
    atomic_store(&window_open, 1);
    struct epoll_event evs[MAX_EVENTS];
    for (; started < total && started < inflight; started++)
        start_op(t, &t->clients[started], now);
    uint64_t limit = t0 + (uint64_t)((cfg.timeout + 60.0) * 1e9);
    int open_count = 0, failed = 0;
    while (now < limit) {
        int n = epoll_wait(t->epfd, evs, MAX_EVENTS, 5);
        now = now_ns();
        for (int i = 0; i < n; i++)
            on_event(t, evs[i].data.ptr, evs[i].events, now);
        scan(t, now);
        open_count = failed = 0;
        for (int i = 0; i < started; i++) {
            open_count += t->clients[i].state == S_HELD;
            failed += t->clients[i].state == S_DONE;
        }
        for (; started < total && started - open_count - failed < inflight; started++)
            start_op(t, &t->clients[started], now);
        if (open_count + failed == total)
            break;
    }
    printf("{\"event\": \"ready\", \"open\": %d, \"failed\": %d, \"seconds\": %.3f, ", open_count,
           failed, (double)(now - t0) / 1e9);
    print_errors(t->kinds);
    printf("}\n");
    fflush(stdout);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, 0, &ev);
    uint64_t until = now_ns() + (uint64_t)(cfg.hold * 1e9);
    int dropped = 0, go = 0;
    while (!go && now_ns() < until) {
        int n = epoll_wait(t->epfd, evs, MAX_EVENTS, 100);
        for (int i = 0; i < n; i++) {
            struct client *c = evs[i].data.ptr;
            if (!c) {
                go = 1;
                continue;
            }
            char sink[BUFSZ];
            ssize_t got = read(c->fd, sink, sizeof sink);
            if (got == 0 || (got < 0 && errno != EAGAIN)) {
                drop(c);
                c->state = S_DONE;
                dropped++;
            }
        }
    }
    for (int i = 0; i < total; i++)
        drop(&t->clients[i]);
    usleep(200000);
    printf("{\"event\": \"closed\", \"dropped\": %d}\n", dropped);
    fflush(stdout);
    return 0;
}

/* --- one tunnel ------------------------------------------------------------------------- */

static void read_exact(int fd, char *buf, size_t n) {
    size_t have = 0;
    while (have < n) {
        ssize_t got = read(fd, buf + have, n - have);
        if (got <= 0) {
            errno = got == 0 ? ECONNRESET : errno;
            die("handshake read");
        }
        have += (size_t)got;
    }
}

static void write_all(int fd, const char *buf, size_t n) {
    while (n) {
        ssize_t put = write(fd, buf, n);
        if (put <= 0)
            die("write");
        buf += put;
        n -= (size_t)put;
    }
}

static void blocking_handshake(int fd) {
    char buf[BUFSZ];
    if (cfg.via == V_CONNECT) {
        write_all(fd, connect_req, connect_req_len);
        size_t have = 0;
        /* Byte by byte: nothing past the reply head may be read (the sink sends nothing). */
        while (have < 4 || memcmp(buf + have - 4, "\r\n\r\n", 4) != 0) {
            if (have == sizeof buf)
                usage("CONNECT reply too long");
            read_exact(fd, buf + have, 1);
            have++;
        }
        if (memcmp(buf + 8, " 200", 4) != 0)
            usage("CONNECT was refused");
    } else if (cfg.via == V_SOCKS5) {
        write_all(fd, socks_greeting, 3);
        read_exact(fd, buf, 2);
        if (buf[0] != 5 || buf[1] != 0)
            usage("SOCKS5 method refused");
        write_all(fd, socks_req, socks_req_len);
        read_exact(fd, buf, 5);
        if (buf[1] != 0)
            usage("SOCKS5 request refused");
        size_t rest = buf[3] == 1 ? 5 : buf[3] == 4 ? 17 : (size_t)(unsigned char)buf[4] + 2;
        read_exact(fd, buf + 5, rest);
    }
}

static int run_throughput(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&cfg.dial, sizeof cfg.dial) < 0)
        die("connect");
    struct timeval tv = {.tv_sec = 120};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    blocking_handshake(fd);
    char *chunk = malloc(cfg.chunk);
    if (!chunk)
        die("malloc");
    memset(chunk, 'x', cfg.chunk);
    unsigned char header[9] = {'U'};
    for (int i = 0; i < 8; i++)
        header[1 + i] = (unsigned char)(cfg.bytes >> (56 - 8 * i));
    struct cpu_mark a, b;
    mark(&a);
    write_all(fd, (char *)header, sizeof header);
    for (uint64_t left = cfg.bytes; left;) {
        size_t n = left < cfg.chunk ? (size_t)left : cfg.chunk;
        write_all(fd, chunk, n);
        left -= n;
    }
    char ack;
    read_exact(fd, &ack, 1);
    mark(&b);
    close(fd);
    if (ack != 'K')
        usage("the sink did not acknowledge");
    double secs = (double)(b.at - a.at) / 1e9;
    printf("{\"mode\": \"throughput\", \"via\": \"%s\", \"bytes\": %llu, \"seconds\": %.4f, "
           "\"mb_per_s\": %.1f, ",
           via_name(), (unsigned long long)cfg.bytes, secs, (double)cfg.bytes / secs / 1e6);
    print_cpu(&a, &b);
    printf("}\n");
    return 0;
}

/* --- arguments --------------------------------------------------------------------------- */

static void parse_addr(const char *text, struct sockaddr_in *out, char *host, size_t hostlen,
                       int *port) {
    const char *colon = strrchr(text, ':');
    char h[256];
    if (!colon || (size_t)(colon - text) >= sizeof h)
        usage("an address is HOST:PORT");
    memcpy(h, text, (size_t)(colon - text));
    h[colon - text] = 0;
    int p = atoi(colon + 1);
    if (p <= 0 || p > 65535)
        usage("bad port");
    if (host)
        snprintf(host, hostlen, "%s", h);
    if (port)
        *port = p;
    if (out) {
        memset(out, 0, sizeof *out);
        out->sin_family = AF_INET;
        out->sin_port = htons((uint16_t)p);
        if (inet_pton(AF_INET, h, &out->sin_addr) != 1)
            usage("the address to dial must be an IPv4 literal");
    }
}

static void add_group(const char *spec) {
    const char *eq = strchr(spec, '=');
    if (!eq || ngroups == MAX_GROUPS || (size_t)(eq - spec) >= sizeof groups[0].name)
        usage("--cpu NAME=PID[,PID...]");
    struct group *g = &groups[ngroups++];
    memcpy(g->name, spec, (size_t)(eq - spec));
    for (const char *p = eq + 1; *p && g->npids < MAX_PIDS;) {
        g->pids[g->npids++] = atoi(p);
        p = strchr(p, ',');
        if (!p)
            break;
        p++;
    }
}

static void parse_args(int argc, char **argv) {
    if (argc < 2)
        usage("no mode");
    const char *m = argv[1];
    cfg.mode = !strcmp(m, "tunnel")       ? M_TUNNEL
               : !strcmp(m, "http")       ? M_HTTP
               : !strcmp(m, "throughput") ? M_THROUGHPUT
               : !strcmp(m, "idle")       ? M_IDLE
                                          : (usage("unknown mode"), M_TUNNEL);
    cfg.concurrency = 1, cfg.threads = 1, cfg.warmup = 0.3, cfg.duration = 3.0;
    cfg.timeout = 10.0, cfg.hold = 120.0, cfg.payload = 64, cfg.socks_domain = 1;
    cfg.requests_per_conn = 1, cfg.bytes = 1ull << 30, cfg.chunk = 1 << 20;
    const char *via = "direct", *proxy = NULL, *target = NULL;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            usage("an option lacks its value");
        i++;
        if (!strcmp(a, "--via")) via = v;
        else if (!strcmp(a, "--proxy")) proxy = v;
        else if (!strcmp(a, "--target")) target = v;
        else if (!strcmp(a, "--concurrency")) cfg.concurrency = atoi(v);
        else if (!strcmp(a, "--threads")) cfg.threads = atoi(v);
        else if (!strcmp(a, "--warmup")) cfg.warmup = atof(v);
        else if (!strcmp(a, "--duration")) cfg.duration = atof(v);
        else if (!strcmp(a, "--timeout")) cfg.timeout = atof(v);
        else if (!strcmp(a, "--hold")) cfg.hold = atof(v);
        else if (!strcmp(a, "--count")) cfg.count = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--payload")) cfg.payload = atoi(v);
        else if (!strcmp(a, "--requests-per-connection")) cfg.requests_per_conn = atoi(v);
        else if (!strcmp(a, "--bytes")) cfg.bytes = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--chunk")) cfg.chunk = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--cpu")) add_group(v);
        else if (!strcmp(a, "--socks-atyp")) cfg.socks_domain = strcmp(v, "ipv4") != 0;
        else usage("unknown option");
    }
    cfg.via = !strcmp(via, "direct")    ? V_DIRECT
              : !strcmp(via, "connect") ? V_CONNECT
              : !strcmp(via, "socks5")  ? V_SOCKS5
              : !strcmp(via, "proxy")   ? V_PROXY
                                        : (usage("unknown --via"), V_DIRECT);
    if (!target)
        usage("--target is required");
    if ((cfg.via == V_PROXY) != (cfg.mode == M_HTTP && cfg.via != V_DIRECT))
        usage("--via proxy is for http (and http takes direct or proxy)");
    if (cfg.via != V_DIRECT && !proxy)
        usage("--proxy is required unless --via direct");
    if (cfg.mode == M_IDLE && cfg.via == V_DIRECT)
        usage("idle needs a proxy");
    parse_addr(target, cfg.via == V_DIRECT ? &cfg.dial : NULL, cfg.target_host,
               sizeof cfg.target_host, &cfg.target_port);
    if (proxy && cfg.via != V_DIRECT)
        parse_addr(proxy, &cfg.dial, NULL, 0, NULL);
    if (cfg.concurrency < 1 || cfg.threads < 1 || cfg.threads > MAX_THREADS || cfg.payload < 1 ||
        cfg.payload > BUFSZ || cfg.duration <= 0 || cfg.chunk < 1)
        usage("a number is out of range");
    if (cfg.mode == M_IDLE && cfg.count < 1)
        usage("idle needs --count");
}

int main(int argc, char **argv) {
    parse_args(argc, argv);
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    build_requests();
    switch (cfg.mode) {
    case M_THROUGHPUT: return run_throughput();
    case M_IDLE: return run_idle();
    default: return run_load();
    }
}
