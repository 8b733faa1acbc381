/*
 * Loopback origins for benchmarks/proxy.py, in one process: built by
 * benchmarks/setup.sh into benchmarks/build/origin.
 *
 *   origin [--threads N]      # prints {"bulk": P, "echo": P, "http": P}, serves until killed
 *
 * Listens on 127.0.0.1 only, on three free ports:
 * - bulk: the sink for one-tunnel throughput, a blocking thread per
 *   connection: a 9-byte header ('U' and a big-endian u64 N), then N bytes
 *   read in 4 MiB reads, answered with one byte 'K'; then reads to EOF.
 * - echo: writes back whatever it reads, closes on EOF.
 * - http: answers every request head with a fixed 200 response with a
 *   13-byte body (keep-alive, HTTP/1.1; closes after answering a request that
 *   says `Connection: close` or is HTTP/1.0); request bodies are not expected.
 *
 * echo and http run on N threads (default 2), each with its own epoll and its
 * own SO_REUSEPORT listener on the same port (the kernel spreads connections
 * over them), edge-triggered, reading a connection as soon as it is accepted
 * (TCP_DEFER_ACCEPT: accept wakes when the first bytes are in). It replaces a
 * uvloop origin that saturated before the direct rows did.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define BUFSZ 4096
#define MAX_EVENTS 256
#define MAX_THREADS 16
#define BULK_CHUNK (4 << 20)

static const char body[] = "hello, proxy\n";
static char response[256], response_close[256];
static size_t response_len, response_close_len;

enum role { R_ECHO = 1, R_HTTP = 2 };

struct conn {
    int fd;
    enum role role;
    size_t have;          /* request bytes buffered (http) */
    size_t outlen, outoff; /* bytes waiting for EPOLLOUT */
    int close_after;
    char buf[BUFSZ];
    char out[BUFSZ];
};

struct listener {
    int fd;
    enum role role;
};

struct worker {
    pthread_t tid;
    int epfd;
    struct listener echo, http;
};


__attribute__((noreturn)) static void die(const char *what) {
    fprintf(stderr, "origin: %s: %s\n", what, strerror(errno));
    exit(1);
}

static int listen_on(int port, int defer) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) < 0)
        die("socket");
    if (defer)
        setsockopt(fd, IPPROTO_TCP, TCP_DEFER_ACCEPT, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 4096) < 0)
        die("bind/listen");
    return fd;
}

static int port_of(int fd) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    if (getsockname(fd, (struct sockaddr *)&a, &len) < 0)
        die("getsockname");
    return ntohs(a.sin_port);
}

/* Closes and frees: callers return at once (nothing in an epoll batch can name c again,
 * since one event per fd is reported per epoll_wait and no handler closes another fd). */
static void drop(struct conn *c) {
    close(c->fd);
    free(c);
}

/* Writes `data`; what the socket cannot take now is kept and EPOLLOUT armed. 0: ok. */
static int put(int epfd, struct conn *c, const char *data, size_t len) {
    ssize_t n = write(c->fd, data, len);
    if (n == (ssize_t)len)
        return 0;
    if (n < 0 && errno != EAGAIN)
        return -1;
    size_t done = n > 0 ? (size_t)n : 0;
    if (len - done > BUFSZ)
        return -1;
    memcpy(c->out, data + done, len - done);
    c->outlen = len - done, c->outoff = 0;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, .data.ptr = c};
    /* ENOENT: not registered yet (served right after accept); the ADD arms EPOLLOUT. */
    if (epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev) < 0 && errno != ENOENT)
        return -1;
    return 0;
}

/* Answers every complete request head in c->buf. 0: keep reading; -1: close. */
static int http_heads(int epfd, struct conn *c) {
    char out[BUFSZ];
    size_t outlen = 0, at = 0;
    int closing = 0;
    while (!closing) {
        char *end = memmem(c->buf + at, c->have - at, "\r\n\r\n", 4);
        if (!end)
            break;
        size_t len = (size_t)(end - (c->buf + at)) + 4;
        char *head = c->buf + at, *eol = memmem(head, len, "\r\n", 2);
        int http10 = eol && eol - head >= 8 && memcmp(eol - 8, "HTTP/1.0", 8) == 0;
        closing = http10 || memmem(head, len, "onnection: close", 16) ||
                  memmem(head, len, "onnection: Close", 16);
        const char *r = closing ? response_close : response;
        size_t rlen = closing ? response_close_len : response_len;
        if (outlen + rlen > sizeof out)
            return -1;
        memcpy(out + outlen, r, rlen);
        outlen += rlen;
        at += len;
    }
    memmove(c->buf, c->buf + at, c->have - at);
    c->have -= at;
    if (outlen && put(epfd, c, out, outlen) < 0)
        return -1;
    if (closing) {
        if (c->outlen > c->outoff)
            c->close_after = 1;
        else
            return -1;
    }
    return c->have == BUFSZ ? -1 : 0;
}

/* Reads what the connection has (edge-triggered) and answers it; -1: it closed (freed) c. */
static int serve(int epfd, struct conn *c, uint32_t events) {
    if (c->outlen > c->outoff) {
        ssize_t n = write(c->fd, c->out + c->outoff, c->outlen - c->outoff);
        if (n < 0 && errno != EAGAIN) {
            drop(c);
            return -1;
        }
        if (n > 0)
            c->outoff += (size_t)n;
        if (c->outoff < c->outlen)
            return 0; /* more EPOLLOUT to come; reading waits (back-pressure) */
        c->outlen = c->outoff = 0;
        if (c->close_after) {
            drop(c);
            return -1;
        }
    }
    int hup = events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR);
    for (;;) {
        size_t space = BUFSZ - (c->role == R_HTTP ? c->have : 0);
        char *into = c->role == R_HTTP ? c->buf + c->have : c->buf;
        ssize_t n = read(c->fd, into, space);
        if (n > 0) {
            if (c->role == R_ECHO) {
                if (put(epfd, c, into, (size_t)n) < 0) {
                    drop(c);
                    return -1;
                }
            } else {
                c->have += (size_t)n;
                if (http_heads(epfd, c) < 0) {
                    drop(c);
                    return -1;
                }
            }
            if (c->outlen > c->outoff || c->close_after)
                return 0;
            if ((size_t)n < space && !hup)
                return 0;
            continue;
        }
        if (n < 0 && errno == EAGAIN)
            return 0;
        drop(c); /* EOF or error */
        return -1;
    }
}

/* One allocation per connection, freed when it closes: connections never share state
 * across threads (an fd number closed on one thread may be reused at once on another). */
static struct conn *conn_for(int fd, enum role role) {
    struct conn *c = malloc(sizeof *c);
    if (!c)
        return NULL;
    c->fd = fd, c->role = role, c->have = c->outlen = c->outoff = 0, c->close_after = 0;
    return c;
}

static void accept_all(int epfd, struct listener *l) {
    for (int i = 0; i < 64; i++) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        struct conn *c = conn_for(fd, l->role);
        if (!c) {
            close(fd);
            continue;
        }
        /* The first bytes are usually in already: serve them before registering. */
        if (serve(epfd, c, 0) < 0)
            continue;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.ptr = c};
        if (c->outlen > c->outoff)
            ev.events |= EPOLLOUT;
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
            drop(c);
    }
}

static void *run_worker(void *arg) {
    struct worker *w = arg;
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(w->epfd, evs, MAX_EVENTS, -1);
        for (int i = 0; i < n; i++) {
            void *p = evs[i].data.ptr;
            if (p == &w->echo || p == &w->http)
                accept_all(w->epfd, p);
            else
                serve(w->epfd, p, evs[i].events);
        }
    }
    return NULL;
}

/* --- bulk ------------------------------------------------------------------------------- */

static int read_full(int fd, unsigned char *buf, size_t n) {
    for (size_t have = 0; have < n;) {
        ssize_t got = read(fd, buf + have, n - have);
        if (got <= 0)
            return -1;
        have += (size_t)got;
    }
    return 0;
}

static void *bulk_conn(void *arg) {
    int fd = (int)(intptr_t)arg;
    char *buf = malloc(BULK_CHUNK);
    unsigned char header[9];
    if (buf && read_full(fd, header, sizeof header) == 0 && header[0] == 'U') {
        uint64_t left = 0;
        for (int i = 1; i < 9; i++)
            left = left << 8 | header[i];
        while (left) {
            ssize_t got = read(fd, buf, left < BULK_CHUNK ? (size_t)left : BULK_CHUNK);
            if (got <= 0)
                break;
            left -= (uint64_t)got;
        }
        if (!left && write(fd, "K", 1) == 1)
            while (read(fd, buf, BULK_CHUNK) > 0) {
            }
    }
    free(buf);
    close(fd);
    return NULL;
}

static void *run_bulk(void *arg) {
    int lfd = (int)(intptr_t)arg;
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) {
                usleep(1000);
                continue;
            }
            die("accept");
        }
        pthread_t tid;
        if (pthread_create(&tid, NULL, bulk_conn, (void *)(intptr_t)fd) != 0)
            close(fd);
        else
            pthread_detach(tid);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int threads = 2;
    for (int i = 1; i + 1 < argc; i += 2)
        if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
    if (threads < 1 || threads > MAX_THREADS) {
        fprintf(stderr, "usage: origin [--threads 1-%d]\n", MAX_THREADS);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    response_len = (size_t)snprintf(response, sizeof response,
                                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                    "Content-Length: %zu\r\n\r\n%s",
                                    sizeof body - 1, body);
    response_close_len = (size_t)snprintf(response_close, sizeof response_close,
                                          "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                          "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                                          sizeof body - 1, body);

    int bulk = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bulk < 0 || bind(bulk, (struct sockaddr *)&a, sizeof a) < 0 || listen(bulk, 64) < 0)
        die("bulk listener");
    struct worker *ws = calloc((size_t)threads, sizeof *ws);
    if (!ws)
        die("calloc");
    int echo_port = 0, http_port = 0;
    for (int i = 0; i < threads; i++) {
        struct worker *w = &ws[i];
        w->echo = (struct listener){listen_on(echo_port, 1), R_ECHO};
        w->http = (struct listener){listen_on(http_port, 1), R_HTTP};
        echo_port = port_of(w->echo.fd), http_port = port_of(w->http.fd);
        w->epfd = epoll_create1(EPOLL_CLOEXEC);
        if (w->epfd < 0)
            die("epoll_create1");
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &w->echo};
        epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->echo.fd, &ev);
        ev.data.ptr = &w->http;
        epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->http.fd, &ev);
    }
    printf("{\"bulk\": %d, \"echo\": %d, \"http\": %d}\n", port_of(bulk), echo_port, http_port);
    fflush(stdout);
    pthread_t tid;
    if (pthread_create(&tid, NULL, run_bulk, (void *)(intptr_t)bulk) != 0)
        die("pthread_create");
    for (int i = 1; i < threads; i++)
        if (pthread_create(&ws[i].tid, NULL, run_worker, &ws[i]) != 0)
            die("pthread_create");
    run_worker(&ws[0]);
    return 0;
}
