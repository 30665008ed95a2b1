// The sandbox ("pause") container of the real node's pods: it holds the pod's namespaces,
// reaps orphans (it is PID 1 when the pod shares its PID namespace) and exits on SIGTERM or
// SIGINT. Written for kaon's local cluster: no registry is reachable there, so the usual
// registry.k8s.io/pause image cannot be pulled. e2e/build-images.sh builds it as a static
// binary and packs it alone into an image.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for { // reap every child that has exited
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
