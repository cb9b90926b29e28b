{{/* Names ------------------------------------------------------------------------------------------ */}}
{{- define "ecrec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ecrec.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ecrec.operatorName" -}}
{{- printf "%s-operator" (include "ecrec.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ecrec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ecrec.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------------------- */}}
{{- define "ecrec.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "ecrec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ecrec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ecrec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The operator's pod: what its Deployment, Service, NetworkPolicy and the job pods' policies select. */}}
{{- define "ecrec.operatorSelectorLabels" -}}
{{ include "ecrec.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Images ------------------------------------------------------------------------------------------ */}}
{{- define "ecrec.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "ecrec.workerImage" -}}
{{- include "ecrec.image" . -}}{{- if .Values.image.cudaWorkers -}}-cuda{{- end -}}
{{- end -}}

{{- define "ecrec.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (.Values.operator.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* RBAC rules: the same as operator/deploy/rbac.yaml (tests/test_chart.py compares them). Split by scope:
the namespaced ones go into a Role per watched namespace when watchNamespaces is set. */}}
{{- define "ecrec.rules.namespaced" -}}
# The jobs: watched; kopf's finalizer (the status timer needs one) and progress annotations are patches;
# deleted once runPolicy.ttlSecondsAfterFinished has passed.
- apiGroups: [ecrec.dev]
  resources: [ecrecjobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [ecrec.dev]
  resources: [ecrecjobs/status]
  verbs: [get, patch]
# The job's processes: created, watched (an index and an event handler), deleted when lost or finished;
# a warm spare's labels patched when it takes over a shard.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [create]
# The job token (ecrec.auth): a Secret per job, created with its Service, read for the operator's own calls.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# Kubernetes Events on the ECRecJob (kopf.info / kopf.warn).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.networkPolicy.enabled }}
# Each job's NetworkPolicy (networkPolicy.enabled), created with its Service.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create]
{{- end }}
{{- end -}}

{{- define "ecrec.rules.cluster" -}}
# kopf watches CRDs and namespaces to know what it can serve.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
# The failure-domain label (spec.servers.failureDomain) of the nodes the servers run on: the job condition
# FailureDomainsAtRisk. Read by name only (get), cached.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get]
{{- end -}}

{{/* Leader election (ecrec-operator --leader-elect): the same as the Role in operator/deploy/rbac.yaml. */}}
{{- define "ecrec.rules.leaderElection" -}}
# Its Lease: created once (a create cannot be limited to a name), then read and renewed.
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{{ include "ecrec.operatorName" . }}]
  verbs: [get, update]
{{- end -}}

{{/* The operator's config (ecrec-operator --config): the job pods' defaults, render.PodDefaults. */}}
{{- define "ecrec.operatorConfig" -}}
{{- $image := include "ecrec.image" . -}}
{{- $secrets := list -}}
{{- range .Values.imagePullSecrets }}{{- $secrets = append $secrets .name -}}{{- end -}}
{{- $operatorPeer := dict
      "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace))
      "podSelector" (dict "matchLabels" (include "ecrec.operatorSelectorLabels" . | fromYaml)) -}}
{{- $config := dict
      "images" (dict "coordinator" $image "server" $image "worker" (include "ecrec.workerImage" .))
      "imagePullPolicy" .Values.image.pullPolicy
      "imagePullSecrets" $secrets
      "podSecurityContext" .Values.podSecurityContext
      "containerSecurityContext" .Values.securityContext
      "labels" .Values.jobPods.labels
      "networkPolicy" (dict
        "enabled" .Values.networkPolicy.enabled
        "operatorPeers" (list $operatorPeer)
        "metricsFrom" .Values.networkPolicy.metricsFrom
        "extraEgress" .Values.networkPolicy.jobExtraEgress) -}}
{{- toPrettyJson $config -}}
{{- end -}}

{{- define "ecrec.watchesAll" -}}
{{- if not .Values.watchNamespaces -}}true{{- end -}}
{{- end -}}
