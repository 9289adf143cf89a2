{{/*
Names. For the usual release name "crucible" these are the names of the generated manifests
(manifests/rbac/operator.yaml): ServiceAccount, ClusterRole and binding "crucible-operator".
*/}}
{{- define "crucible.fullname" -}}
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

{{- define "crucible.operatorName" -}}
{{- printf "%s-operator" (include "crucible.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "crucible.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "crucible.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "crucible.operatorSubject" -}}
- kind: ServiceAccount
  name: {{ include "crucible.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end -}}

{{- define "crucible.selectorLabels" -}}
app.kubernetes.io/name: crucible-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "crucible.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "crucible.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: crucible
{{- end -}}

{{/*
The operator's ClusterRole, read from the generated manifests/rbac/operator.yaml (files/ links to
it): the chart never keeps a second copy of its rules. tests/ship/test_chart.py checks the
rendered rules equal crucible.operator.rbac.RULES.
*/}}
{{- define "crucible.generatedClusterRole" -}}
{{- $role := dict -}}
{{- range $doc := regexSplit "(?m)^---\\s*$" (.Files.Get "files/operator-rbac.yaml") -1 -}}
{{- $obj := fromYaml $doc -}}
{{- if eq (get $obj "kind") "ClusterRole" -}}
{{- $role = $obj -}}
{{- end -}}
{{- end -}}
{{- if not $role.rules -}}
{{- fail "files/operator-rbac.yaml has no ClusterRole: regenerate it with `crucible-operator rbac`" -}}
{{- end -}}
{{- toJson $role -}}
{{- end -}}

{{- define "crucible.generatedRules" -}}
{{- $rules := list -}}
{{- range $rule := (include "crucible.generatedClusterRole" . | fromJson).rules -}}
{{- if or $.Values.kueue.enabled (not (has "kueue.x-k8s.io" $rule.apiGroups)) -}}
{{- $rules = append $rules $rule -}}
{{- end -}}
{{- end -}}
{{- toYaml $rules -}}
{{- end -}}

{{/* Resources of the generated rules that are cluster-scoped, as the generated ClusterRole's
     crucible.dev/cluster-scoped-resources annotation lists them (crucible/operator/rbac.py). */}}
{{- define "crucible.clusterScoped" -}}
{{- $role := include "crucible.generatedClusterRole" . | fromJson -}}
{{- $scoped := index (default dict $role.metadata.annotations) "crucible.dev/cluster-scoped-resources" | default "" -}}
{{- if not $scoped -}}
{{- fail "files/operator-rbac.yaml's ClusterRole lacks crucible.dev/cluster-scoped-resources: regenerate it with `crucible-operator rbac`" -}}
{{- end -}}
{{- toJson (splitList "," $scoped) -}}
{{- end -}}

{{/* A list of names as CEL string literals: 'a', 'b' (names are label keys or DNS names: no quotes). */}}
{{- define "crucible.celStrings" -}}
{{- range $i, $v := . }}{{ if $i }}, {{ end }}'{{ $v }}'{{ end }}
{{- end -}}
