//go:build tools

// Package cluster pins the Kubernetes components the cluster tests build (their `app`
// packages, importable where the commands are not).
package cluster

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
	// kubectl's command tree (cmd/kubectl is a main package).
	_ "k8s.io/kubectl/pkg/cmd"
)
