/*
 * kvprobe's bind() shim for the Mooncake store client (LD_PRELOAD in the worker only).
 *
 * Mooncake 0.3.13/0.3.14's Transfer Engine binds its handshake port to INADDR_ANY
 * (transfer_metadata_plugin.cpp findAvailableTcpPort) and its TCP-transport port to in6addr_any
 * with IPV6_V6ONLY off (tcp_transport TcpContext), with no setting to narrow either:
 * local_hostname only names the address it advertises. While KVPROBE_BIND_HOST holds an
 * IPv4 or IPv6 literal, this shim turns a bind to an unspecified address into a bind to it:
 * 0.0.0.0 -> HOST (IPv4 HOST), :: -> HOST (IPv6 HOST) or ::ffff:HOST (IPv4 HOST, on a socket
 * that takes IPv4). Every other bind passes unchanged. kvprobe then checks what the worker
 * listens on (src/mem/mooncake.rs check_listening) and refuses a wider address.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("KVPROBE_BIND_HOST");
    struct in_addr h4;
    struct in6_addr h6;
    int is4 = host != NULL && inet_pton(AF_INET, host, &h4) == 1;
    int is6 = host != NULL && !is4 && inet_pton(AF_INET6, host, &h6) == 1;
    if (addr == NULL || (!is4 && !is6)) {
        return real(fd, addr, len);
    }
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in) && is4) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr = h4;
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            if (is6) {
                a.sin6_addr = h6;
                return real(fd, (const struct sockaddr *)&a, sizeof a);
            }
            int v6only = 0;
            socklen_t n = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &n) == 0 && !v6only) {
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&a.sin6_addr.s6_addr[12], &h4, 4);
                return real(fd, (const struct sockaddr *)&a, sizeof a);
            }
        }
    }
    return real(fd, addr, len);
}
