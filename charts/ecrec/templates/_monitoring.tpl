{{/* Whether to render the ServiceMonitor/PodMonitor: "true" or "". With monitoring.enabled on a cluster that
does not serve monitoring.coreos.com/v1, the render fails with the reason (Prometheus would scrape nothing and
say nothing) unless monitoring.requireCRDs is false. `helm template` knows only the API versions it is given:
--api-versions monitoring.coreos.com/v1. */}}
{{- define "ecrec.monitors" -}}
{{- $m := .Values.monitoring -}}
{{- if and $m.enabled (or $m.serviceMonitor.enabled $m.podMonitor.enabled) -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}
true
{{- else if $m.requireCRDs -}}
{{- fail "monitoring.enabled is true but this cluster does not serve monitoring.coreos.com/v1 (the ServiceMonitor and PodMonitor CRDs of the Prometheus Operator): install kube-prometheus-stack (or its CRDs) first, or set monitoring.enabled=false, or monitoring.requireCRDs=false to skip the monitors where the API is missing. `helm template` needs --api-versions monitoring.coreos.com/v1" -}}
{{- end -}}
{{- end -}}
{{- end -}}
