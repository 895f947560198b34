"""The word list of the wordle environment: common five-letter English words, lowercase.

Written for this package (not taken from any game's list); secrets are drawn from it.
"""

WORDS = tuple("""
about above actor acute admit adopt adult after again agent agree ahead alarm album alert alike
alive allow alone along alter among angel anger angle angry apart apple apply arena argue arise
array aside asset audio avoid award aware badly baker basic beach begin being below bench birth
black blade blame blank blast blend blind block blood board boost booth bound brain brand bread
break breed brick brief bring broad brown brush build built buyer cabin cable candy carry catch
cause chain chair chalk charm chart chase cheap check chess chest chief child chose civil claim
class clean clear climb clock close cloud coach coast could count court cover craft crane crash
cream crime cross crowd crown curve cycle daily dance dealt death delay depth dirty doubt dozen
draft drama drawn dream dress drink drive eager early earth eight elite empty enemy enjoy enter
entry equal error event every exact exist extra faith false fancy fault favor fence field fifth
fifty fight final first flame flash fleet floor fluid focus force forth forty forum found frame
fresh front fruit fully funny giant given glass globe glory grace grade grain grand grant grape
grass great green greet group guard guess guest guide happy harsh heart heavy hello hobby honey
horse hotel house human humor ideal image index inner input issue jelly joint judge juice knife
label large laser later laugh layer learn lease least leave legal lemon level light limit local
logic loose lover lower lucky lunch magic major maker march match maybe mayor medal metal meter
might minor model money month moral motor mount mouse mouth movie music nerve never night noise
north novel nurse ocean offer often olive onion order other ought owner paint panel paper party
peace pearl phase phone photo piano piece pilot pitch place plain plane plant plate point pound
power press price pride prime print prize proof proud prove queen quick quiet quite radio raise
range rapid ratio reach ready relax reply right river robot rough round route royal rural salad
scale scene scope score sense serve seven shade shake shape share sharp sheep sheet shelf shell
shift shine shirt shock shore short shown sight silly since skill sleep slice slide small smart
smile smoke snake solid solve sound south space spare speak speed spend spent spice spoon sport
staff stage stair stake stand start state steam steel stick still stock stone stood store storm
story stove strip stuck study style sugar suite sunny super sweet table taste teach thank theme
there thick thing think third those three threw throw tiger tight timer title toast today token
topic total touch tough tower track trade train treat trend trial tribe trick truck truly trust
truth twice uncle under union unity upper upset urban usage usual valid value video virus visit
vital vivid voice waste watch water wheel where which while white whole woman world worry worth
would write wrong yield young youth zebra
""".split())
