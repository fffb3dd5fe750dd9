# ruff: noqa: E501 - the page is one HTML document; its script lines are kept whole
"""The monitor's page: one self-contained HTML document (inline CSS and JavaScript, no external
assets, so it works on an air-gapped cluster). It polls ``api/job`` once a second and redraws: a
row per rank, the elastic rounds, the last failure and its culprit, a chart of step times. Its
"Stacks" section fetches ``api/stacks`` when asked (a button): each rank's main-thread stack and
flight record, with how old they are."""

from __future__ import annotations

__all__ = ["HTML"]

HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Horovod job</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:#f6f7f9;color:#1d232b}
header{background:#1d232b;color:#fff;padding:10px 18px;display:flex;gap:24px;align-items:baseline}
header h1{font-size:17px;margin:0}
header span{opacity:.8}
main{padding:14px 18px;display:grid;gap:14px;grid-template-columns:minmax(0,3fr) minmax(0,2fr)}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px 12px}
section h2{font-size:14px;margin:0 0 8px}
table{border-collapse:collapse;width:100%}
th,td{text-align:right;padding:4px 8px;border-bottom:1px solid #eef0f3;white-space:nowrap}
th:nth-child(-n+2),td:nth-child(-n+2){text-align:left}
th{font-weight:600;color:#55606e}
.state{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600}
.running{background:#dff5e3;color:#17692b}.finished{background:#e6eaf0;color:#46505c}
.straggler{background:#fff1cc;color:#8a5a00}.stalled{background:#ffe2c6;color:#9a4300}
.failed{background:#ffd9d9;color:#a11818}.silent,.starting,.stopped{background:#eceff3;color:#69737f}
#failure.none{color:#69737f}
#failure .culprit{font-weight:600;color:#a11818}
pre{background:#f6f7f9;padding:6px;margin:6px 0 0;white-space:pre-wrap;font-size:12px;max-height:9em;overflow:auto}
#chart{width:100%;height:220px}
.legend span{margin-right:10px;font-size:12px}
.wide{grid-column:1/-1}
#stacks pre{max-height:24em}
#stacks .stale{color:#a11818;font-weight:600}
</style></head>
<body>
<header><h1>Horovod job</h1><span id="summary">connecting&hellip;</span><span id="updated"></span></header>
<main>
<section class="wide"><h2>Ranks</h2>
<table id="ranks"><thead><tr><th>host</th><th>rank</th><th>local</th><th>steps/s</th><th>steps</th>
<th>waiting for peers (s)</th><th>bytes</th><th>straggler score</th><th>state</th></tr></thead>
<tbody></tbody></table></section>
<section><h2>Step time per rank (ms)</h2><svg id="chart" viewBox="0 0 600 220" preserveAspectRatio="none"></svg>
<div class="legend" id="legend"></div></section>
<section><h2>Last failure</h2><div id="failure" class="none">none</div>
<h2 style="margin-top:12px">Elastic</h2><div id="elastic">static job</div></section>
<section class="wide"><h2>Stacks <button id="stacks-fetch" type="button">fetch where every rank is</button>
<a id="stacks-link" href="api/stacks">api/stacks</a></h2>
<div id="stacks">each rank's main-thread stack and flight record, as of its last report</div></section>
</main>
<script>
"use strict";
var COLORS=["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b","#e377c2","#17becf","#7f7f7f","#bcbd22"];
function el(tag,text,cls){var e=document.createElement(tag);if(text!==undefined)e.textContent=text;if(cls)e.className=cls;return e;}
function bytes(n){var u=["B","KiB","MiB","GiB","TiB"],i=0;while(n>=1024&&i<u.length-1){n/=1024;i++;}return (i?n.toFixed(1):n)+" "+u[i];}
function rows(job){
  var tb=document.querySelector("#ranks tbody");tb.textContent="";
  job.ranks.forEach(function(r){
    var tr=el("tr");tr.setAttribute("data-rank",r.rank);tr.setAttribute("data-state",r.state);
    [r.host,r.rank,r.local_rank,r.step_rate.toFixed(1),r.steps,r.wait_seconds.toFixed(2),bytes(r.bytes),
     r.straggler_score.toFixed(2)].forEach(function(v){tr.appendChild(el("td",String(v)));});
    var td=el("td");td.appendChild(el("span",r.state,"state "+r.state));tr.appendChild(td);tb.appendChild(tr);
  });
}
function chart(job){
  var svg=document.getElementById("chart"),legend=document.getElementById("legend"),NS="http://www.w3.org/2000/svg";
  svg.textContent="";legend.textContent="";
  var series=job.ranks.map(function(r){return r.step_times.slice(-100).map(function(t){return t*1000;});});
  // The scale follows the bulk of the steps (3x their 90th percentile): one stall does not flatten the rest.
  var all=[];series.forEach(function(s){all=all.concat(s);});all.sort(function(a,b){return a-b;});
  var max=all.length?Math.min(all[all.length-1],3*all[Math.floor(0.9*(all.length-1))]):0;
  if(!max){var t=document.createElementNS(NS,"text");t.setAttribute("x",10);t.setAttribute("y",20);t.textContent="no steps yet";svg.appendChild(t);return;}
  max*=1.1;
  for(var g=0;g<=4;g++){var y=210-g*50,l=document.createElementNS(NS,"line");l.setAttribute("x1",40);l.setAttribute("x2",600);
    l.setAttribute("y1",y);l.setAttribute("y2",y);l.setAttribute("stroke","#eef0f3");svg.appendChild(l);
    var tx=document.createElementNS(NS,"text");tx.setAttribute("x",2);tx.setAttribute("y",y+4);tx.setAttribute("font-size","11");
    tx.setAttribute("fill","#69737f");tx.textContent=(max*g/4).toFixed(max<10?1:0);svg.appendChild(tx);}
  series.forEach(function(s,i){
    if(!s.length)return;var c=COLORS[i%COLORS.length],pts=[];
    s.forEach(function(v,j){pts.push((40+560*(s.length>1?j/(s.length-1):0)).toFixed(1)+","+(210-200*Math.min(v,max)/max).toFixed(1));});
    var p=document.createElementNS(NS,"polyline");p.setAttribute("points",pts.join(" "));p.setAttribute("fill","none");
    p.setAttribute("stroke",c);p.setAttribute("stroke-width","1.5");p.setAttribute("data-rank",job.ranks[i].rank);svg.appendChild(p);
    var k=el("span","rank "+job.ranks[i].rank);k.style.color=c;legend.appendChild(k);
  });
}
function failure(job){
  var f=document.getElementById("failure");f.textContent="";
  if(!job.failure){f.className="none";f.textContent=job.finished?"none (the job finished)":"none";return;}
  f.className="";var x=job.failure;
  f.appendChild(el("span",(x.rank===null?"the launcher":"rank "+x.rank)+" on "+x.host,"culprit"));
  f.appendChild(el("span"," \\u2014 "+x.status));
  if(x.error)f.appendChild(el("pre",x.error));
  if(x.stderr_tail&&x.stderr_tail.length)f.appendChild(el("pre",x.stderr_tail.join("\\n")));
}
function elastic(job){
  var e=document.getElementById("elastic");
  if(!job.elastic){e.textContent="static job";return;}
  var w=job.elastic.workers||{},parts=Object.keys(w).sort().map(function(k){return w[k]+" "+k;});
  e.textContent=job.elastic.rounds+" round(s); workers: "+(parts.join(", ")||"none");
}
function draw(job){
  var s=job.world_size+" ranks";
  if(job.stragglers.length)s+=" \\u00b7 straggler(s): rank "+job.stragglers.join(", ");
  if(job.failure)s+=" \\u00b7 FAILED";else if(job.finished)s+=" \\u00b7 finished";
  document.getElementById("summary").textContent=s;
  document.getElementById("updated").textContent="updated "+new Date().toLocaleTimeString();
  rows(job);chart(job);failure(job);elastic(job);
}
function stacks(){
  var q=window.location.search,x=new XMLHttpRequest(),d=document.getElementById("stacks");
  x.open("GET","api/stacks"+q);x.timeout=10000;
  x.onload=function(){
    if(x.status!==200){d.textContent="api/stacks answered "+x.status;return;}
    var all=JSON.parse(x.responseText);d.textContent="";
    all.ranks.forEach(function(r){
      var div=el("div");div.setAttribute("data-rank",r.rank);
      var head="rank "+r.rank+" on "+r.host+(r.pid?" (pid "+r.pid+")":"")+" \\u2014 "+r.state;
      if(r.age_seconds===null){div.appendChild(el("div",head+": no stack reported yet"));d.appendChild(div);return;}
      div.appendChild(el("div",head+", in "+r.where+", "));
      div.appendChild(el("span",r.age_seconds.toFixed(1)+" s ago",r.age_seconds>10?"stale":""));
      var text="Main thread (most recent call last):\\n"+(r.stack||"")+"\\nFlight record (completed, then in flight):\\n"+r.flight_text.join("\\n");
      div.appendChild(el("pre",text));d.appendChild(div);
    });
  };
  x.onerror=x.ontimeout=function(){d.textContent="monitor unreachable";};
  x.send();
}
document.getElementById("stacks-fetch").onclick=stacks;
document.getElementById("stacks-link").href="api/stacks"+window.location.search;
function poll(){
  var q=window.location.search,x=new XMLHttpRequest();
  x.open("GET","api/job"+q);x.timeout=5000;
  x.onload=function(){if(x.status===200){draw(JSON.parse(x.responseText));}setTimeout(poll,1000);};
  x.onerror=x.ontimeout=function(){document.getElementById("updated").textContent="monitor unreachable";setTimeout(poll,2000);};
  x.send();
}
poll();
</script></body></html>
"""
