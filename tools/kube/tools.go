//go:build tools

// Package tools pins the Kubernetes API server and etcd that the tests run
// (tests/kube.py): `make setup` builds both into bin/ from these versions.
// k8s.io/kubernetes is not meant to be imported as a module, so go.mod maps
// each of its staging modules (k8s.io/api, ...) to the release of the same
// version, as the Kubernetes project advises for such builds.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
