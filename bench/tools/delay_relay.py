#!/usr/bin/python3
"""A TCP relay that adds latency: ssh's ProxyCommand for the benchmark's "remote" source
when `--rtt-ms` is given (the kernel here has no netem). Every chunk read in either
direction is written out `delay` later, in order, so the round trip grows by 2 x delay and
the bandwidth stays the link's (HTB on the veth).

    delay_relay.py DELAY_MS HOST PORT        (stdin/stdout <-> HOST:PORT)

Ends when either side closes.
"""
import os
import queue
import socket
import sys
import threading
import time


def pump(read, write, close, delay):
    q = queue.Queue()

    def reader():
        while True:
            data = read()
            q.put((time.monotonic() + delay, data))
            if not data:
                return

    threading.Thread(target=reader, daemon=True).start()
    while True:
        due, data = q.get()
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        if not data:
            close()
            return
        write(data)


def main():
    delay = float(sys.argv[1]) / 1000.0
    s = socket.create_connection((sys.argv[2], int(sys.argv[3])))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()

    def write_all(fd, data):
        while data:
            n = os.write(fd, data)
            data = data[n:]

    up = threading.Thread(target=pump, daemon=True, args=(
        lambda: os.read(stdin, 65536), s.sendall,
        lambda: s.shutdown(socket.SHUT_WR), delay))
    up.start()
    pump(lambda: s.recv(65536), lambda d: write_all(stdout, d),
         lambda: os.close(stdout), delay)


if __name__ == "__main__":
    main()
