{{- define "verifypd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "verifypd.labels" -}}
app.kubernetes.io/name: verifypd-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "verifypd.selector" -}}
app.kubernetes.io/name: verifypd-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "verifypd.serviceAccountName" -}}
{{- default (include "verifypd.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "verifypd.otlpService" -}}
{{- printf "%s-otlp" (include "verifypd.fullname" .) -}}
{{- end -}}

{{- define "verifypd.otlpEndpoint" -}}
{{- default (printf "http://%s.%s.svc:%d" (include "verifypd.otlpService" .) .Release.Namespace (int .Values.otlp.port)) .Values.otlp.endpoint -}}
{{- end -}}

{{/* Where the chart's default config lands and where NOTES and `helm test` look for a config:
defaultConfig.namespace, else the first watched namespace (the operator must see it), else the
release namespace. */}}
{{- define "verifypd.configNamespace" -}}
{{- $watched := .Values.operator.watchNamespaces -}}
{{- .Values.defaultConfig.namespace | default (empty $watched | ternary .Release.Namespace (first $watched)) -}}
{{- end -}}

{{/* The VerifyPDConfig whose gateway Service (named after it) NOTES and `helm test` call. */}}
{{- define "verifypd.testConfigName" -}}
{{- .Values.test.configName | default .Values.defaultConfig.name -}}
{{- end -}}

{{- define "verifypd.serviceImage" -}}
{{- printf "%s:%s" .Values.serviceImage.repository (default .Chart.AppVersion .Values.serviceImage.tag) -}}
{{- end -}}

{{/* The operator's rules: least privilege for what handlers.py / kube.py / kopf do. */}}
{{- define "verifypd.namespacedRules" -}}
- apiGroups: [verifypd.dev]
  resources: [verifypdconfigs]
  verbs: [get, list, watch, patch]
- apiGroups: [verifypd.dev]
  resources: [verifypdconfigs/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, create, patch, delete]
- apiGroups: [resource.k8s.io]
  resources: [resourceclaimtemplates]
  verbs: [get, list, create, patch, delete]
# The lanes' shared secret and the NetworkPolicy that keeps lane ports to the gateway, per config.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, create, patch, delete]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
{{- if has .Values.tls.mode (list "cert-manager" "auto") }}
# TLS through cert-manager: a config's Certificates and Issuers (docs/kubernetes.md "TLS").
- apiGroups: [cert-manager.io]
  resources: [certificates, issuers]
  verbs: [get, list, create, patch, delete]
{{- end }}
{{- end -}}
